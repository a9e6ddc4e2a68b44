//! Splits model output into reasoning (`<think>…</think>`) and answer text.
//! A `<think>` is honoured only at the very start of the output (after
//! whitespace): later occurrences are ordinary text, e.g. code that mentions
//! the tag. When the chat template already opened `<think>` in the prompt,
//! the splitter starts inside the reasoning.

/// A piece of output, classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
}

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Nothing but whitespace seen yet; `<think>` may still come.
    Start,
    Reasoning,
    /// Just after `</think>`: the blank lines the model puts there are dropped.
    AfterThink,
    Content,
}

#[derive(Debug, Clone)]
pub struct ReasoningSplitter {
    mode: Mode,
    buf: String,
    /// The newline right after `<think>` is formatting, not reasoning.
    reasoning_started: bool,
}

/// Length of the longest suffix of `text` that is a proper prefix of `tag`.
pub fn partial_tag_suffix(text: &str, tag: &str) -> usize {
    for (start, _) in text.char_indices() {
        let suffix = &text[start..];
        if suffix.len() < tag.len() && tag.starts_with(suffix) {
            return text.len() - start;
        }
    }
    0
}

impl ReasoningSplitter {
    /// `prompt_opens_reasoning`: the rendered prompt ends inside `<think>`.
    pub fn new(prompt_opens_reasoning: bool) -> Self {
        ReasoningSplitter {
            mode: if prompt_opens_reasoning {
                Mode::Reasoning
            } else {
                Mode::Start
            },
            buf: String::new(),
            reasoning_started: false,
        }
    }

    pub fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        self.buf.push_str(text);
        loop {
            match self.mode {
                Mode::Start => {
                    let t = self.buf.trim_start();
                    if let Some(rest) = t.strip_prefix(OPEN) {
                        self.buf = rest.to_string();
                        self.mode = Mode::Reasoning;
                        continue;
                    }
                    if OPEN.starts_with(t) {
                        return;
                    }
                    self.mode = Mode::Content;
                }
                Mode::Reasoning => {
                    if !self.reasoning_started {
                        if self.buf.is_empty() {
                            return;
                        }
                        if let Some(rest) = self.buf.strip_prefix('\n') {
                            self.buf = rest.to_string();
                        }
                        self.reasoning_started = true;
                    }
                    if let Some(pos) = self.buf.find(CLOSE) {
                        let reasoning = self.buf[..pos].to_string();
                        self.buf.drain(..pos + CLOSE.len());
                        emit(out, Piece::Reasoning(reasoning));
                        self.mode = Mode::AfterThink;
                        continue;
                    }
                    let keep = partial_tag_suffix(&self.buf, CLOSE);
                    let cut = self.buf.len() - keep;
                    let reasoning: String = self.buf.drain(..cut).collect();
                    emit(out, Piece::Reasoning(reasoning));
                    return;
                }
                Mode::AfterThink => {
                    let trimmed = self.buf.trim_start();
                    if trimmed.is_empty() {
                        self.buf.clear();
                        return;
                    }
                    self.buf = trimmed.to_string();
                    self.mode = Mode::Content;
                }
                Mode::Content => {
                    let content = std::mem::take(&mut self.buf);
                    emit(out, Piece::Content(content));
                    return;
                }
            }
        }
    }

    /// End of output: held-back text is emitted as what it was.
    pub fn finish(&mut self, out: &mut Vec<Piece>) {
        let rest = std::mem::take(&mut self.buf);
        match self.mode {
            Mode::Start | Mode::Content => emit(out, Piece::Content(rest)),
            Mode::Reasoning => emit(out, Piece::Reasoning(rest)),
            Mode::AfterThink => {}
        }
    }
}

fn emit(out: &mut Vec<Piece>, piece: Piece) {
    let empty = match &piece {
        Piece::Reasoning(s) | Piece::Content(s) => s.is_empty(),
    };
    if !empty {
        out.push(piece);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn split(open: bool, chunks: &[&str]) -> (String, String) {
        let mut s = ReasoningSplitter::new(open);
        let mut out = Vec::new();
        for c in chunks {
            s.push(c, &mut out);
        }
        s.finish(&mut out);
        let (mut r, mut c) = (String::new(), String::new());
        for p in out {
            match p {
                Piece::Reasoning(t) => r.push_str(&t),
                Piece::Content(t) => c.push_str(&t),
            }
        }
        (r, c)
    }

    #[test]
    fn think_block_becomes_reasoning() {
        assert_eq!(
            split(false, &["<think>\nplan it\n</think>\n\nAnswer."]),
            ("plan it\n".into(), "Answer.".into())
        );
    }

    #[test]
    fn prompt_opened_think_starts_mid_reasoning() {
        assert_eq!(
            split(true, &["still thinking</think>\n\nDone"]),
            ("still thinking".into(), "Done".into())
        );
    }

    #[test]
    fn no_think_is_plain_content_and_late_tags_are_text() {
        assert_eq!(
            split(false, &["Hi <think>x</think>"]),
            (String::new(), "Hi <think>x</think>".into())
        );
    }

    #[test]
    fn truncated_reasoning_is_still_reasoning() {
        assert_eq!(
            split(false, &["<think>half a thou"]),
            ("half a thou".into(), String::new())
        );
        assert_eq!(split(false, &["<thi"]), (String::new(), "<thi".into()));
    }

    proptest! {
        #[test]
        fn chunking_does_not_change_the_result(
            open in any::<bool>(),
            text in "(<think>|</think>|\n|a|b| |<|/){0,30}",
            cuts in proptest::collection::vec(0usize..200, 0..10),
        ) {
            let whole = split(open, &[text.as_str()]);
            let mut idx: Vec<usize> = cuts.into_iter().filter(|c| *c <= text.len()).collect();
            idx.sort();
            let mut chunks = Vec::new();
            let mut last = 0;
            for i in idx { chunks.push(&text[last..i]); last = i; }
            chunks.push(&text[last..]);
            prop_assert_eq!(split(open, &chunks), whole);
        }
    }
}
