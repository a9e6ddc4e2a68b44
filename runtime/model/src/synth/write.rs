//! Streaming shard writer: tensors are cut into pieces, a bounded batch of
//! pieces is generated in parallel (rayon) while a writer thread appends the
//! previous batch to the shard through a `BufWriter`, so memory stays at a
//! few hundred MB whatever the model size and generation overlaps the disk.

use super::error::SynthError;
use super::shards::{ShardPlan, safetensors_header};
use super::spec::{Storage, SynthDtype, TensorDesc};
use super::values::{encode, fill_f32};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

/// Elements per piece: 4 MiB of BF16, big enough to amortise the per-piece
/// RNG seek, small enough to balance across cores. A multiple of the MXFP4
/// block (32), so MXFP4 pieces hold whole blocks.
const PIECE_ELEMS: usize = 1 << 21;
/// Pieces generated per parallel batch (~128 MiB of BF16).
const BATCH_PIECES: usize = 32;
/// Pieces queued for the writer; bounds memory to ~2 batches.
const QUEUE_PIECES: usize = 32;
const _: () = assert!(PIECE_ELEMS.is_multiple_of(crate::formats::mxfp4::BLOCK_VALUES));

struct Piece<'a> {
    tensor: &'a TensorDesc,
    start: usize,
    len: usize,
}

enum Msg {
    Open { path: PathBuf, header: Vec<u8> },
    Data(Vec<u8>),
}

/// The stored bytes of source elements `start..start + len` of a tensor
/// (for an MXFP4 part, whole 32-value blocks: pieces are multiples of 32).
fn gen_piece(seed: u64, dtype: SynthDtype, p: &Piece) -> Vec<u8> {
    if let Storage::Mxfp4 { part, source } = &p.tensor.storage {
        return super::mxfp4::encode_piece(seed, source, &p.tensor.init, *part, p.start, p.len);
    }
    let dtype = p.tensor.float_dtype(dtype);
    let mut vals = vec![0f32; p.len];
    fill_f32(
        seed,
        &p.tensor.name,
        &p.tensor.init,
        dtype,
        p.tensor.row_len(),
        p.start,
        &mut vals,
    );
    let mut bytes = Vec::with_capacity(p.len * dtype.size());
    encode(&vals, dtype, &mut bytes);
    bytes
}

fn progress_bar(total: u64, show: bool) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    // The stderr target hides itself when stderr is not a terminal.
    let pb = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "synth {wide_bar} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} ETA {eta}",
    ) {
        pb.set_style(style);
    }
    pb
}

fn finish_file(current: Option<(PathBuf, BufWriter<File>)>) -> Result<(), SynthError> {
    if let Some((path, w)) = current {
        let file = w
            .into_inner()
            .map_err(|e| SynthError::io(&path, e.into_error()))?;
        file.sync_all().map_err(|e| SynthError::io(&path, e))?;
    }
    Ok(())
}

fn write_loop(rx: Receiver<Msg>, pb: &ProgressBar) -> Result<(), SynthError> {
    let mut current: Option<(PathBuf, BufWriter<File>)> = None;
    for msg in rx {
        match msg {
            Msg::Open { path, header } => {
                finish_file(current.take())?;
                let file = File::create(&path).map_err(|e| SynthError::io(&path, e))?;
                let mut w = BufWriter::with_capacity(8 << 20, file);
                w.write_all(&header).map_err(|e| SynthError::io(&path, e))?;
                current = Some((path, w));
            }
            Msg::Data(bytes) => {
                let (path, w) = current
                    .as_mut()
                    .expect("producer opens a shard before sending data");
                w.write_all(&bytes).map_err(|e| SynthError::io(&*path, e))?;
                pb.inc(bytes.len() as u64);
            }
        }
    }
    finish_file(current)
}

/// Sends every piece of every shard, generating one batch while the writer
/// drains the previous one. Returns early (Ok) if the writer hung up; the
/// writer's own result then carries the error.
fn produce(shards: &[ShardPlan], dir: &Path, seed: u64, dtype: SynthDtype, tx: SyncSender<Msg>) {
    for shard in shards {
        let header = safetensors_header(shard, dtype);
        let open = Msg::Open {
            path: dir.join(&shard.file),
            header,
        };
        if tx.send(open).is_err() {
            return;
        }
        let pieces: Vec<Piece> = shard
            .tensors
            .iter()
            .flat_map(|t| {
                let n = t.source_numel();
                (0..n.div_ceil(PIECE_ELEMS)).map(move |k| Piece {
                    tensor: t,
                    start: k * PIECE_ELEMS,
                    len: PIECE_ELEMS.min(n - k * PIECE_ELEMS),
                })
            })
            .collect();
        for batch in pieces.chunks(BATCH_PIECES) {
            let bufs: Vec<Vec<u8>> = batch
                .par_iter()
                .map(|p| gen_piece(seed, dtype, p))
                .collect();
            for b in bufs {
                if tx.send(Msg::Data(b)).is_err() {
                    return;
                }
            }
        }
    }
}

/// Writes all shards into `dir`, with a progress bar on stderr when `show`.
pub fn write_shards(
    shards: &[ShardPlan],
    dir: &Path,
    seed: u64,
    dtype: SynthDtype,
    show: bool,
) -> Result<(), SynthError> {
    let total: u64 = shards.iter().map(|s| s.data_bytes(dtype)).sum();
    let pb = progress_bar(total, show);
    let (tx, rx) = sync_channel::<Msg>(QUEUE_PIECES);
    let result = std::thread::scope(|s| {
        let writer = s.spawn(|| write_loop(rx, &pb));
        produce(shards, dir, seed, dtype, tx);
        writer.join()
    });
    pb.finish_and_clear();
    match result {
        Ok(r) => r,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}
