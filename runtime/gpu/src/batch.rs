//! Continuous batching in the CUDA engine: [`Batch`] for [`CudaEngine`]
//! (the step interface is `krasis_model::batch`; design and measurements in
//! `docs/notes/batching-cuda.md`).
//!
//! **Admission** reserves what a sequence can ever need: a sampler slot
//! (its row of penalty counts) and `prompt + max_new_tokens - 1` rows of
//! the KV arena (within the context; `arena.rs`); when either is taken the
//! answer is `Wait`, so a running sequence never fails for memory.
//!
//! **A step** first ends the cancelled sequences (wherever they are; their
//! rows are free at once), then runs at most one prefill chunk of the
//! oldest sequence still prefilling (all resident; with HCS its whole
//! prompt, see below), its first token sampled when its last chunk ends;
//! the other sequences still prefilling join that chunk (**packed
//! prefill**, `Positions::Packed`: the oldest's next tokens, then the next
//! sequence's, ... up to one chunk of rows in one forward pass, RoPE / KV
//! append / attention per sequence, everything else over all rows at once;
//! prompts of at most `gemv_tokens` tokens prefill alone). With HCS the
//! pass is the waiting prompts whole, within the context's tokens, in one
//! streamed pass (`streamed.rs`): the non-resident experts cross PCIe once
//! for all of them. Then one decode step of every sequence that was
//! decoding when the step began (one token per sequence per step; a
//! sequence's last `Token` and its `Done` come in the same step): M rows
//! (the order they were admitted in) through [`crate::forward`] with m =
//! M, each row at its own position in its own KV rows (`scratch.pos`,
//! `scratch.kv_base`), the LM head over the M rows, and each row sampled
//! with its own parameters, step index and penalty counts. A decode step
//! of M rows replays the CUDA graph captured for M (after one eager step
//! of M); with HCS each MoE layer's device-side tail lookup places the
//! union of the rows' experts (`hcs/tail.rs`).
//!
//! **Stall bound.** A running decode waits for at most one prefill chunk
//! (`prefill_chunk` tokens) per token, all resident. With HCS, prefill
//! streams the non-resident experts through the reclaimable tier, which
//! decode's experts live in, so a prompt's prefill cannot stop between
//! chunks for a decode step without reloading the tier: a new request's
//! whole streamed prefill runs in one step and the running decodes wait
//! for it (its PCIe pass plus its compute; see the note for the figures).
//!
//! **Exactness.** Every row is computed independently with a fixed
//! reduction order (the decode kernels are row-invariant), and a
//! sequence's prefill is its own chunks into its own KV rows, so its
//! tokens and logits are the same alone or beside others
//! (`runtime/gpu/tests/batching.rs`).

use crate::arena::KvArena;
use crate::engine::{CudaEngine, kernel_sampling, sampled_token};
use crate::error::{GpuError, Result};
use crate::stats::LivePublisher;
use cudarc::driver::{CudaEvent, sys};
use krasis_model::batch::{
    Admission, Batch, KvUsage, SeqEvent, SeqId, check_constraint, finish_after_token,
};
use krasis_model::prefix_cache::Hit;
use krasis_model::structured::{Constraint, Grammar};
use krasis_model::{EngineError, FinishReason, GenerateOutcome, GenerateRequest, GenerateStats};
use std::collections::HashMap;
use std::time::Instant;

/// Where a sequence is.
#[derive(Debug)]
enum Phase {
    /// Admitted, nothing run yet (the prefix cache is looked up, its
    /// sampler counts cleared, at its first chunk).
    Queued,
    /// Prefilled up to `next` (a chunk boundary), `hit` its prefix-cache
    /// reuse (for the store once the prefill completes).
    Prefill { next: usize, hit: Option<Hit> },
    /// `token` (the last sampled) is fed back at `pos` next step.
    Decode { token: u32, pos: usize },
    /// Ends at the next step with this reason and no further work
    /// (`max_new_tokens == 0`).
    Finished(FinishReason),
}

/// One running sequence.
struct Seq {
    id: SeqId,
    req: GenerateRequest,
    params: krasis_kernels::SamplingParams,
    /// Its row of `scratch.counts` (the sampler's penalty counts).
    slot: usize,
    /// Its KV rows `[base, base + rows)` (rows 0: it reserved none).
    base: usize,
    rows: usize,
    phase: Phase,
    stats: GenerateStats,
    /// When its first prefill chunk started, and its first token came.
    prefill_start: Option<Instant>,
    decode_start: Option<Instant>,
    publisher: LivePublisher,
    /// Keep the logits each token was sampled from (exactness checks).
    record: Option<Vec<Vec<f32>>>,
    /// Its place in the request's grammar, when it has one (`masks.rs`).
    constraint: Option<Constraint>,
    /// Its grammar could not give the next token's mask: it ends with
    /// this error instead of the token sampled without one.
    mask_error: Option<EngineError>,
}

impl Seq {
    /// Where its KV lives: its arena rows and its slot's rings.
    fn kv(&self) -> crate::forward::SeqKv {
        crate::forward::SeqKv {
            base: self.base,
            slot: self.slot,
        }
    }
}

/// Device time of the parts of the last step, from CUDA events (when
/// [`CudaEngine::set_step_timing`] is on).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct StepTiming {
    /// Prompt tokens prefilled this step (0: no prefill).
    pub prefill_tokens: usize,
    pub prefill_ms: f64,
    /// Rows of the decode step (0: none).
    pub decode_rows: usize,
    /// The decode step's forward pass, LM head and sampling.
    pub decode_ms: f64,
    /// Whether the decode step replayed a captured graph.
    pub graph: bool,
}

/// The running sequences and what they hold.
pub(crate) struct Sequences {
    capacity: usize,
    arena: KvArena,
    next_id: u64,
    /// Admission order (oldest first): the prefill order and the decode
    /// rows' order.
    seqs: Vec<Seq>,
    free_slots: Vec<usize>,
    /// Logits of recording sequences that ended, until taken.
    recorded: HashMap<SeqId, Vec<Vec<f32>>>,
    /// The live progress of sequences just released, until their final
    /// figures are published.
    ended: HashMap<SeqId, krasis_model::LiveProgress>,
    timing: Option<[CudaEvent; 3]>,
    pub(crate) last_step: Option<StepTiming>,
    /// The decode step left in flight for the next step to read
    /// (`ahead.rs`), and the pinned rows such steps copy through.
    ahead: Option<ahead::Ahead>,
    pinned: Option<ahead::PinnedRows>,
}

impl Sequences {
    pub(crate) fn new(capacity: usize, rows: usize) -> Self {
        Sequences {
            capacity,
            arena: KvArena::new(rows),
            next_id: 0,
            seqs: Vec::new(),
            free_slots: (0..capacity).rev().collect(),
            recorded: HashMap::new(),
            ended: HashMap::new(),
            timing: None,
            last_step: None,
            ahead: None,
            pinned: None,
        }
    }

    pub(crate) fn active(&self) -> usize {
        self.seqs.len()
    }

    /// Whether a decode step is left in flight (`ahead.rs`).
    pub(crate) fn has_step_ahead(&self) -> bool {
        self.ahead.is_some()
    }
}

/// KV rows a request can ever write: its prompt, then one per generated
/// token fed back (the last is never fed back), within the context.
pub(crate) fn rows_needed(prompt: usize, max_new_tokens: usize, context: usize) -> usize {
    (prompt + max_new_tokens.saturating_sub(1))
        .min(context)
        .max(prompt)
}

/// The index of the sequence a step prefills: the oldest one still
/// prefilling (admission order), if any.
fn prefill_turn(phases: &[bool]) -> Option<usize> {
    phases.iter().position(|&p| p)
}

/// A recorded single request (`CudaEngine::run_recorded`).
pub(crate) struct RecordedRun {
    pub(crate) tokens: Vec<u32>,
    pub(crate) logits: Vec<Vec<f32>>,
    pub(crate) outcome: GenerateOutcome,
}

impl CudaEngine {
    /// Most sequences one decode step runs (`Batch::capacity`).
    pub fn parallel(&self) -> usize {
        self.batch.capacity
    }

    /// KV arena rows reserved by running sequences, and the arena's size.
    pub fn kv_rows_used(&self) -> (usize, usize) {
        (self.batch.arena.used_rows(), self.batch.arena.rows())
    }

    /// [`Batch::admit`] of a sequence that keeps the logits each of its
    /// tokens was sampled from (the first from prefill, the rest from its
    /// decode rows), for exactness checks; [`CudaEngine::take_recorded`]
    /// returns them once it ended. Costs a logits download per token.
    pub fn admit_recording(&mut self, req: GenerateRequest) -> Result<Admission, EngineError> {
        self.admit_seq(req, true)
    }

    /// The logits recorded for `seq` (admitted with
    /// [`CudaEngine::admit_recording`]), once it has ended.
    pub fn take_recorded(&mut self, seq: SeqId) -> Option<Vec<Vec<f32>>> {
        self.batch.recorded.remove(&seq)
    }

    /// Records the device time of each step's prefill and decode parts
    /// with CUDA events ([`CudaEngine::last_step_timing`]); off by default
    /// (the token path then carries no instrumentation).
    pub fn set_step_timing(&mut self, on: bool) -> Result<()> {
        self.batch.timing = if on {
            let ev = || {
                self.model
                    .gpu
                    .ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(GpuError::driver("creating a step timing event"))
            };
            Some([ev()?, ev()?, ev()?])
        } else {
            None
        };
        self.batch.last_step = None;
        Ok(())
    }

    /// The device time of the last step's parts (with step timing on).
    pub fn last_step_timing(&self) -> Option<StepTiming> {
        self.batch.last_step
    }

    /// One request alone through the batch, recording its tokens and
    /// logits (the engine must be idle).
    pub(crate) fn run_recorded(&mut self, req: &GenerateRequest) -> Result<RecordedRun> {
        let seq = match self.admit_seq(req.clone(), true)? {
            Admission::Admitted(s) => s,
            Admission::Wait => {
                return Err(GpuError::Unsupported(
                    "the idle engine has no room for the request".into(),
                ));
            }
        };
        let mut tokens = Vec::new();
        let mut events = Vec::new();
        loop {
            events.clear();
            self.step_seqs(&mut events)?;
            for ev in events.drain(..) {
                match ev {
                    SeqEvent::Token { seq: s, token } if s == seq => tokens.push(token),
                    SeqEvent::Done { seq: s, result } if s == seq => {
                        let outcome = result?;
                        let logits = self.take_recorded(seq).unwrap_or_default();
                        return Ok(RecordedRun {
                            tokens,
                            logits,
                            outcome,
                        });
                    }
                    other => {
                        return Err(GpuError::Unsupported(format!(
                            "an idle engine reported an event of another sequence: {other:?}"
                        )));
                    }
                }
            }
        }
    }

    fn admit_seq(&mut self, req: GenerateRequest, record: bool) -> Result<Admission, EngineError> {
        self.check_tokens(&req.prompt)?;
        check_constraint(&req)?;
        let params = kernel_sampling(&req.sampling)?;
        let b = &mut self.batch;
        if b.seqs.len() >= b.capacity {
            return Ok(Admission::Wait);
        }
        let (phase, base, rows) = if req.max_new_tokens == 0 {
            (Phase::Finished(FinishReason::Length), 0, 0)
        } else {
            let rows = rows_needed(req.prompt.len(), req.max_new_tokens, self.context);
            match b.arena.reserve(rows) {
                Some(base) => (Phase::Queued, base, rows),
                None => return Ok(Admission::Wait),
            }
        };
        let slot = b
            .free_slots
            .pop()
            .expect("a free sampler slot for every sequence below the capacity");
        let id = SeqId(b.next_id);
        b.next_id += 1;
        let stats = GenerateStats {
            prompt_tokens: req.prompt.len(),
            ..GenerateStats::default()
        };
        b.seqs.push(Seq {
            id,
            params,
            slot,
            base,
            rows,
            phase,
            stats,
            prefill_start: None,
            decode_start: None,
            publisher: LivePublisher::new(),
            record: record.then(Vec::new),
            constraint: req.constraint.as_ref().map(Grammar::start),
            mask_error: None,
            req,
        });
        Ok(Admission::Admitted(id))
    }

    /// One step (see the module docs). A returned error is fatal.
    fn step_seqs(&mut self, events: &mut Vec<SeqEvent>) -> Result<()> {
        let mut timing = StepTiming::default();
        self.record_step_event(0)?;
        // Cancelled sequences end at once, wherever they are (queued,
        // prefilling or decoding), and give their rows back; a request for
        // no token ends without any work.
        let ending: Vec<(SeqId, FinishReason)> = self
            .batch
            .seqs
            .iter()
            .filter_map(|s| match s.phase {
                Phase::Finished(f) => Some((s.id, f)),
                _ if s.req.cancel.is_cancelled() => Some((s.id, FinishReason::Cancelled)),
                _ => None,
            })
            .collect();
        for (id, f) in ending {
            self.finish(id, Ok(f), events)?;
        }
        // A decode step left in flight: the next one may go out before its
        // tokens are read (`ahead.rs`); else they are read first.
        let prefill_due = prefill_turn(&self.prefilling()).is_some();
        if self.step_ahead(&self.decoding(), !prefill_due, events)? {
            return Ok(());
        }
        // The rows of this step's decode: the sequences decoding when it
        // began (one token each per step), in admission order.
        let rows = self.decoding();
        let prefilling = self.prefilling();
        if let Some(i) = prefill_turn(&prefilling) {
            let id = self.batch.seqs[i].id;
            // The oldest prefilling sequence leads; others join its pass
            // when it and they can share one (`packable`).
            let packed = self.packable();
            timing.prefill_tokens = if packed.first() == Some(&id) {
                self.prefill_packed_step(&packed, events)?
            } else {
                self.prefill_step(id, events)?
            };
        }
        self.record_step_event(1)?;
        if self.may_leave_ahead(&rows) {
            self.batch.ahead = Some(self.queue_ahead(&rows, 0)?);
        } else if !rows.is_empty() {
            timing.decode_rows = rows.len();
            timing.graph = self.decode_step(&rows, events)?;
        }
        self.record_step_event(2)?;
        self.read_step_timing(timing)
    }

    /// The sequences decoding, in admission order.
    fn decoding(&self) -> Vec<SeqId> {
        self.batch
            .seqs
            .iter()
            .filter(|s| matches!(s.phase, Phase::Decode { .. }))
            .map(|s| s.id)
            .collect()
    }

    /// Per sequence, whether it still has prompt to prefill.
    fn prefilling(&self) -> Vec<bool> {
        self.batch
            .seqs
            .iter()
            .map(|s| matches!(s.phase, Phase::Queued | Phase::Prefill { .. }))
            .collect()
    }

    fn seq(&self, id: SeqId) -> &Seq {
        self.batch
            .seqs
            .iter()
            .find(|s| s.id == id)
            .expect("a running sequence")
    }

    fn seq_mut(&mut self, id: SeqId) -> &mut Seq {
        self.batch
            .seqs
            .iter_mut()
            .find(|s| s.id == id)
            .expect("a running sequence")
    }

    /// The prefill work of this step for sequence `id`: one chunk (all
    /// resident) or the whole prompt (HCS); at its end the first token.
    /// Returns the prompt tokens prefilled. A non-fatal failure ends the
    /// sequence with its error.
    fn prefill_step(&mut self, id: SeqId, events: &mut Vec<SeqEvent>) -> Result<usize> {
        match self.prefill_work(id) {
            Ok(Some((tokens, first))) => {
                if let Some(token) = first {
                    self.first_token(id, token, events)?;
                }
                Ok(tokens)
            }
            // Cancelled before or during the prefill: no token, nothing stored.
            Ok(None) => {
                self.finish(id, Ok(FinishReason::Cancelled), events)?;
                Ok(0)
            }
            Err(e) => {
                let e = EngineError::from(e);
                if e.is_fatal() {
                    return Err(GpuError::Engine(e));
                }
                // The engine is fine (e.g. a streamed prefill out of
                // memory); the sequence ends with the error.
                self.model.gpu.sync("ending a failed prefill")?;
                self.finish(id, Err(e), events)?;
                Ok(0)
            }
        }
    }

    /// `Some((tokens prefilled, the first token once the prompt is done))`,
    /// `None` when cancelled.
    fn prefill_work(&mut self, id: SeqId) -> Result<Option<(usize, Option<u32>)>> {
        let kv = self.seq(id).kv();
        self.begin_prefill(id)?;
        let (prompt, next, cancel, live) = {
            let s = self.seq(id);
            let Phase::Prefill { next, .. } = s.phase else {
                unreachable!("prefilling")
            };
            (
                s.req.prompt.clone(),
                next,
                s.req.cancel.clone(),
                s.req.live.clone(),
            )
        };
        let n = prompt.len();
        // Chunks are counted from where this step resumes (after the
        // cached prefix, or after a packed pass that ended mid-prompt).
        let cap = self.model.scratch.cap;
        let last_chunk_start = next + (n - 1 - next) / cap * cap;
        let reached =
            self.prefill_cancellable(&prompt, (next, 1), kv, &cancel, &live, |m, start, _| {
                if start == last_chunk_start {
                    m.lm_head(n - 1 - start, 1)?;
                }
                Ok(())
            })?;
        let Some(at) = reached else {
            return Ok(None);
        };
        let tokens = at - next;
        if at < n {
            if let Phase::Prefill { next, .. } = &mut self.seq_mut(id).phase {
                *next = at;
            }
            return Ok(Some((tokens, None)));
        }
        // No token once cancelled, even when that came during the last
        // chunk, and nothing stored.
        if cancel.is_cancelled() {
            return Ok(None);
        }
        let token = self.prefilled(id)?;
        Ok(Some((tokens, Some(token))))
    }

    /// The end of `id`'s prefill, its last prompt row's logits in
    /// `scratch.logits` row 0: its first token sampled, then the prompt's
    /// new whole blocks stored into the prefix cache from its rows (after
    /// the sample, which does not wait for the copies; decode writes only
    /// positions past the prompt). Every prefill path ends here.
    fn prefilled(&mut self, id: SeqId) -> Result<u32> {
        let token = self.sample_row(id, 0, 0)?;
        let hit = match std::mem::replace(&mut self.seq_mut(id).phase, Phase::Queued) {
            Phase::Prefill { hit, .. } => hit,
            _ => None,
        };
        let (prompt, kv) = {
            let s = self.seq(id);
            (s.req.prompt.clone(), s.kv())
        };
        self.store_prefix(&prompt, hit.as_ref(), kv)?;
        Ok(token)
    }

    /// A queued sequence's start of prefill (nothing for one already
    /// prefilling): the sampler's penalty counts start empty, and the
    /// prefix cache is looked up (its blocks restored into the sequence's
    /// rows) once, before the first chunk.
    fn begin_prefill(&mut self, id: SeqId) -> Result<()> {
        if !matches!(self.seq(id).phase, Phase::Queued) {
            return Ok(());
        }
        let kv = self.seq(id).kv();
        let slot = kv.slot;
        let v = self.model.geometry.vocab_size;
        let m = &mut self.model;
        m.gpu
            .stream
            .memset_zeros(&mut m.scratch.counts.slice_mut(slot * v..(slot + 1) * v))
            .map_err(GpuError::driver("clearing sampling counts"))?;
        let (prompt, use_cache) = {
            let s = self.seq(id);
            (s.req.prompt.clone(), s.req.cache_prompt)
        };
        let hit = self.reuse_prefix(&prompt, use_cache, kv)?;
        let from = hit.as_ref().map_or(0, |h| h.tokens);
        let s = self.seq_mut(id);
        s.stats.cached_tokens = from;
        s.req.live.set_prefilled(from);
        s.prefill_start = Some(Instant::now());
        s.phase = Phase::Prefill { next: from, hit };
        Ok(())
    }

    /// The sequences whose prefill can share one packed pass, oldest
    /// first: the grouped expert path (a prompt of at most `gemv_tokens`
    /// runs the GEMV path, whose rows differ from the grouped path's, so it
    /// prefills alone), not cancelled. Under HCS a pass streams whole
    /// prompts, so it takes them while their tokens together stay within
    /// the context (the hidden states calibration keeps room for) and the
    /// prefill span. Empty unless at least two qualify.
    fn packable(&self) -> Vec<SeqId> {
        let m = &self.model;
        if m.scratch.grouped.is_none() {
            return Vec::new();
        }
        let limit = match (&m.hcs, m.prefill_span) {
            (None, _) => usize::MAX,
            (Some(_), span) => span.unwrap_or(self.context).min(self.context),
        };
        // A pass computes MXFP4 experts one way (in place or dequantized),
        // and a prompt's rows always take its own way
        // (`mxfp4_in_place_for`): the leader packs only with prompts of
        // its way. (Both ways are row-invariant.)
        let mxfp4 = matches!(m.ffn, Some(crate::expert_ffn::ExpertFfn::Mxfp4 { .. }));
        let way = |s: &Seq| mxfp4 && self.mxfp4_in_place_for(s.req.prompt.len());
        let mut candidates = self
            .batch
            .seqs
            .iter()
            .filter(|s| matches!(s.phase, Phase::Queued | Phase::Prefill { .. }))
            .filter(|s| s.req.prompt.len() > m.gemv_tokens && !s.req.cancel.is_cancelled())
            .peekable();
        let lead = candidates.peek().map(|&s| way(s));
        let mut total = 0usize;
        let ids: Vec<SeqId> = candidates
            .filter(|&s| Some(way(s)) == lead)
            .take_while(|s| {
                total += s.req.prompt.len();
                total <= limit
            })
            .map(|s| s.id)
            .collect();
        if ids.len() < 2 { Vec::new() } else { ids }
    }

    /// One packed prefill pass: the next tokens of `ids` (oldest first),
    /// up to one chunk in all, as one forward pass (`Positions::Packed`);
    /// each sequence whose prompt it completes gets its first token and
    /// stores its prefix. Returns the tokens prefilled. Every row is what
    /// that sequence's own chunk computes (row-invariant GEMMs, per-row
    /// norms and routing, per-sequence RoPE and attention), so a sequence
    /// gets the same logits packed or alone (`tests/batching.rs`).
    fn prefill_packed_step(&mut self, ids: &[SeqId], events: &mut Vec<SeqEvent>) -> Result<usize> {
        match self.packed_work(ids, events) {
            Ok(rows) => Ok(rows),
            Err(e) => {
                let e = EngineError::from(e);
                if e.is_fatal() {
                    return Err(GpuError::Engine(e));
                }
                // The engine is fine; the pass's sequences that have not
                // started decoding end with the error.
                self.model.gpu.sync("ending a failed packed prefill")?;
                for &id in ids {
                    let prefilling = self.batch.seqs.iter().any(|s| {
                        s.id == id && matches!(s.phase, Phase::Queued | Phase::Prefill { .. })
                    });
                    if prefilling {
                        self.finish(id, Err(e.clone()), events)?;
                    }
                }
                Ok(0)
            }
        }
    }

    fn packed_work(&mut self, ids: &[SeqId], events: &mut Vec<SeqEvent>) -> Result<usize> {
        if self.model.hcs.is_some() {
            return self.streamed_packed_work(ids, events);
        }
        let cap = self.model.scratch.cap;
        let mut segs = Vec::new();
        let mut members = Vec::new();
        let mut tokens = Vec::with_capacity(cap);
        for &id in ids {
            if tokens.len() == cap {
                break;
            }
            self.begin_prefill(id)?;
            let s = self.seq(id);
            let Phase::Prefill { next, .. } = s.phase else {
                unreachable!("prefilling")
            };
            let n = s.req.prompt.len();
            let take = (n - next).min(cap - tokens.len());
            if take == 0 {
                return Err(GpuError::Unsupported(format!(
                    "sequence {id:?} has no prompt token left to prefill ({next} of {n})"
                )));
            }
            segs.push(crate::forward::PackedSegment {
                row: tokens.len(),
                len: take,
                start: next,
                base: s.base,
                slot: s.slot,
            });
            members.push((id, next, take, n));
            tokens.extend_from_slice(&s.req.prompt[next..next + take]);
        }
        let rows = tokens.len();
        #[cfg(any(test, feature = "fault-injection"))]
        if segs.len() >= 2 && self.model.fault == crate::forward::Fault::PackedBase {
            segs[1].base = segs[0].base;
        }
        // Every member's prompt is longer than `gemv_tokens` and takes the
        // same MXFP4 way (`packable`): the pass takes the way each would
        // take alone.
        let in_place = members.iter().all(|&(.., n)| self.mxfp4_in_place_for(n));
        let m = &mut self.model;
        m.gpu
            .stream
            .memcpy_htod(&tokens, &mut m.scratch.ids.slice_mut(0..rows))
            .map_err(GpuError::driver("copying prompt tokens to the GPU"))?;
        m.scratch.packed = segs.clone();
        m.grouped_prefill = true;
        m.mxfp4_in_place = in_place;
        m.forward_layers(rows, crate::forward::Positions::Packed)?;
        for (&(id, next, take, n), seg) in members.iter().zip(&segs) {
            let at = next + take;
            let (cancel, live) = {
                let s = self.seq(id);
                (s.req.cancel.clone(), s.req.live.clone())
            };
            live.set_prefilled(at);
            if at < n {
                if let Phase::Prefill { next, .. } = &mut self.seq_mut(id).phase {
                    *next = at;
                }
                continue;
            }
            // No token once cancelled, and nothing stored.
            if cancel.is_cancelled() {
                self.finish(id, Ok(FinishReason::Cancelled), events)?;
                continue;
            }
            self.model.lm_head(seg.row + seg.len - 1, 1)?;
            let token = self.prefilled(id)?;
            self.first_token(id, token, events)?;
        }
        Ok(rows)
    }

    /// The first token of `id` (its prefill done): reported, then the
    /// sequence decodes from it or ends.
    fn first_token(&mut self, id: SeqId, token: u32, events: &mut Vec<SeqEvent>) -> Result<()> {
        if !self.accept_token(id, token, events)? {
            return Ok(());
        }
        let context = self.context;
        let s = self.seq_mut(id);
        let now = Instant::now();
        s.stats.prefill_seconds = s
            .prefill_start
            .map_or(0.0, |t| now.duration_since(t).as_secs_f64());
        s.decode_start = Some(now);
        // Decode's figures are published at most every period from here.
        s.publisher = LivePublisher::new();
        s.stats.generated_tokens = 1;
        let pos = s.req.prompt.len();
        s.phase = Phase::Decode { token, pos };
        events.push(SeqEvent::Token { seq: id, token });
        if let Some(f) = finish_after_token(token, &s.req, 1, context) {
            self.finish(id, Ok(f), events)?;
        }
        Ok(())
    }

    /// Samples the logits in `scratch.logits` row `row` for sequence `id`
    /// (its parameters, counts and step `step`) into `scratch.ids[row]`,
    /// and returns the token (recording the logits if asked).
    fn sample_row(&mut self, id: SeqId, row: usize, step: u64) -> Result<u32> {
        let masked = self.upload_mask(id)?;
        let (slot, params) = {
            let s = self.seq(id);
            (s.slot, s.params)
        };
        let sample = krasis_kernels::SampleRow {
            params,
            step,
            slot,
            masked,
        };
        self.launch_samples(row, &[sample])?;
        let m = &mut self.model;
        let mut out = [0u32; 1];
        m.gpu
            .stream
            .memcpy_dtoh(&m.scratch.ids.slice(row..row + 1), &mut out)
            .map_err(GpuError::driver("reading the sampled token"))?;
        self.record_logits(id, row)?;
        sampled_token(out[0], step)
    }

    /// Ends `id`: frees its rows and slot, reports its outcome as a `Done`
    /// event, and updates the engine's figures.
    fn finish(
        &mut self,
        id: SeqId,
        result: std::result::Result<FinishReason, EngineError>,
        events: &mut Vec<SeqEvent>,
    ) -> Result<()> {
        let outcome = self.release(id, result);
        if let Ok(o) = &outcome {
            self.note_finished(id, o)?;
        }
        events.push(SeqEvent::Done {
            seq: id,
            result: outcome,
        });
        Ok(())
    }

    /// Removes `id` and frees what it held (host bookkeeping only: the
    /// kernels already queued that write its rows run before any later
    /// sequence's, on the same stream); its outcome.
    fn release(
        &mut self,
        id: SeqId,
        result: std::result::Result<FinishReason, EngineError>,
    ) -> std::result::Result<GenerateOutcome, EngineError> {
        let i = self
            .batch
            .seqs
            .iter()
            .position(|s| s.id == id)
            .expect("a running sequence");
        let mut s = self.batch.seqs.remove(i);
        if s.rows > 0 {
            self.batch.arena.release(s.base);
        }
        self.batch.free_slots.push(s.slot);
        if let Some(r) = s.record.take() {
            self.batch.recorded.insert(id, r);
        }
        let finish = result?;
        if let Some(t) = s.decode_start {
            s.stats.decode_seconds = t.elapsed().as_secs_f64();
        } else if let Some(t) = s.prefill_start {
            s.stats.prefill_seconds = t.elapsed().as_secs_f64();
        }
        self.batch.ended.insert(id, s.req.live.clone());
        Ok(GenerateOutcome {
            finish,
            stats: s.stats,
        })
    }

    /// The engine's figures after `id` ended with `o`: its HCS traffic and
    /// prefix-cache timings collected, its final figures published, the
    /// last request's figures.
    fn note_finished(&mut self, id: SeqId, o: &GenerateOutcome) -> Result<()> {
        let live = self.batch.ended.remove(&id).unwrap_or_default();
        let idle = self.batch.seqs.is_empty();
        if o.stats.generated_tokens > 0 {
            // The traffic of the decode steps since the last sequence ended
            // (one request alone: its own).
            self.collect_hcs();
        } else if idle && let Some(h) = self.model.hcs.as_mut() {
            // A request cancelled before its first token: its counters are
            // dropped, so the next request's figures are its own.
            h.take_stats();
        }
        if let Some(p) = self.prefix.as_mut() {
            p.collect_timing()?;
        }
        if o.stats.generated_tokens > 0 {
            // The request's final figures.
            live.publish_engine(self.engine_stats(self.last_hcs.as_ref()));
            let st = &mut self.stats;
            st.requests_completed += 1;
            st.last_prompt_tokens = o.stats.prompt_tokens as u64;
            st.last_generated_tokens = o.stats.generated_tokens as u64;
            st.last_prefill_tok_s = o.stats.prefill_tok_s();
            st.last_decode_tok_s = o.stats.decode_tok_s();
        }
        Ok(())
    }

    fn record_step_event(&self, i: usize) -> Result<()> {
        if let Some(ev) = &self.batch.timing {
            ev[i]
                .record(&self.model.gpu.stream)
                .map_err(GpuError::driver("recording a step timing event"))?;
        }
        Ok(())
    }

    fn read_step_timing(&mut self, mut t: StepTiming) -> Result<()> {
        let Some(ev) = &self.batch.timing else {
            return Ok(());
        };
        ev[2]
            .synchronize()
            .map_err(GpuError::driver("waiting for a step timing event"))?;
        let ms = |a: &CudaEvent, b: &CudaEvent| {
            a.elapsed_ms(b)
                .map(f64::from)
                .map_err(GpuError::driver("reading a step timing event"))
        };
        t.prefill_ms = ms(&ev[0], &ev[1])?;
        t.decode_ms = ms(&ev[1], &ev[2])?;
        self.batch.last_step = Some(t);
        Ok(())
    }
}

impl Batch for CudaEngine {
    fn capacity(&self) -> usize {
        self.batch.capacity
    }

    fn admit(&mut self, req: GenerateRequest) -> Result<Admission, EngineError> {
        self.admit_seq(req, false)
    }

    fn step(&mut self, events: &mut Vec<SeqEvent>) -> Result<(), EngineError> {
        self.step_seqs(events)
            .map_err(|e| match EngineError::from(e) {
                // Every error out of a step is fatal for the engine (batch
                // contract): its sequences are in an unknown state.
                e @ EngineError::Backend(_) => e,
                e => EngineError::Backend(e.to_string()),
            })
    }

    fn end(&mut self, seq: SeqId) -> Option<GenerateOutcome> {
        if !self.batch.seqs.iter().any(|s| s.id == seq) {
            return None;
        }
        let o = self.release(seq, Ok(FinishReason::Cancelled)).ok()?;
        // The sequence is gone whatever the figures do; a driver error
        // reading them surfaces at the next step.
        if let Err(e) = self.note_finished(seq, &o) {
            tracing::warn!(error = %e, "collecting the figures of an ended sequence");
        }
        Some(o)
    }

    fn active(&self) -> usize {
        self.batch.active()
    }

    /// The KV arena in tokens: one row is one position of every
    /// full-attention layer.
    fn kv_usage(&self) -> KvUsage {
        let (used, total) = self.kv_rows_used();
        KvUsage {
            used_tokens: used,
            total_tokens: total,
        }
    }
}

mod ahead;
mod decode;
mod masks;
mod streamed;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_reserves_its_prompt_and_the_tokens_it_feeds_back() {
        // 10 prompt tokens, 5 new: positions 0..14 are written (the 5th
        // new token is never fed back).
        assert_eq!(rows_needed(10, 5, 100), 14);
        assert_eq!(rows_needed(10, 1, 100), 10);
        // Within the context: prompt + generated never exceeds it.
        assert_eq!(rows_needed(90, 50, 100), 100);
        // The prompt itself always fits (checked against the context first).
        assert_eq!(rows_needed(100, 7, 100), 100);
    }

    #[test]
    fn the_oldest_prefilling_sequence_takes_the_step() {
        assert_eq!(prefill_turn(&[false, true, true]), Some(1));
        assert_eq!(prefill_turn(&[true, false, true]), Some(0));
        assert_eq!(prefill_turn(&[false, false]), None);
        assert_eq!(prefill_turn(&[]), None);
    }
}
