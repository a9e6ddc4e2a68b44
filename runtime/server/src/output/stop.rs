//! Stop strings matched across token boundaries. Text that could still turn
//! into a stop string is held back, so a client never sees the start of a
//! stop string that is then cut.

/// What one push produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopStep {
    /// Text that is safe to emit (may be empty).
    Emit(String),
    /// A stop string matched; the text before it, to emit before ending.
    Stopped(String),
}

#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    /// Empty stop strings are ignored: they would match before any output.
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> StopStep {
        if self.stops.is_empty() {
            return StopStep::Emit(text.to_string());
        }
        self.pending.push_str(text);
        let earliest = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(pos) = earliest {
            let before = self.pending[..pos].to_string();
            self.pending.clear();
            return StopStep::Stopped(before);
        }
        let keep = self.held_suffix_len();
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopStep::Emit(out)
    }

    /// The end of the output: whatever was held back is ordinary text.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of a
    /// stop string.
    fn held_suffix_len(&self) -> usize {
        let p = &self.pending;
        let mut best = 0;
        for (start, _) in p.char_indices() {
            let suffix = &p[start..];
            if self.stops.iter().any(|s| s.starts_with(suffix)) {
                best = p.len() - start;
                break;
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run(stops: &[&str], chunks: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for c in chunks {
            match m.push(c) {
                StopStep::Emit(t) => out.push_str(&t),
                StopStep::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_across_tokens_is_cut_and_not_emitted() {
        assert_eq!(
            run(&["STOP"], &["hello S", "TO", "P world"]),
            ("hello ".into(), true)
        );
    }

    #[test]
    fn partial_prefix_is_released_when_it_diverges() {
        assert_eq!(run(&["STOP"], &["a ST", "x"]), ("a STx".into(), false));
        assert_eq!(run(&["STOP"], &["a ST"]), ("a ST".into(), false));
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        assert_eq!(run(&["bb", "a"], &["xxbba"]), ("xx".into(), true));
    }

    #[test]
    fn multibyte_text_is_split_on_char_boundaries() {
        assert_eq!(run(&["é!"], &["caf", "é", "é!"]), ("café".into(), true));
    }

    proptest! {
        #[test]
        fn chunking_does_not_change_the_result(
            text in "[ab ]{0,40}",
            cuts in proptest::collection::vec(0usize..40, 0..8),
        ) {
            let stops = ["ab b", "bba"];
            let whole = run(&stops, &[text.as_str()]);
            let mut idx: Vec<usize> = cuts.into_iter().filter(|c| *c <= text.len()).collect();
            idx.sort();
            let mut chunks = Vec::new();
            let mut last = 0;
            for i in idx { chunks.push(&text[last..i]); last = i; }
            chunks.push(&text[last..]);
            prop_assert_eq!(run(&stops, &chunks), whole);
        }
    }
}
