//! `kbench --tail`: what HCS decode's device tail costs per MoE layer
//! (issue 16: where a constrained decode step's time goes beside the
//! all-resident one). One MoE layer as the decode graph runs it:
//! `tail_lookup`, `tail_fetch`, then the INT4 w13 + w2 GEMVs, graph-timed
//! over 1,536 launches that cycle through 24 layers, against the GEMVs
//! alone, with 0, 1 and 2 cold experts per launch (a3b: H 2048, I 768,
//! top-8 of 128, one row, a tail of 384 slots as the engine sizes it at
//! 6 GiB). Cold experts come from a pool in mapped page-locked host memory
//! and never recur while the tail still holds them, so every launch copies
//! exactly j experts; the tail's counters are printed to show it.

use super::host::{Mapped, fill_experts};
use super::time_graph_ms;
use anyhow::Context;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use krasis_kernels::{ExpertTail, Int4Layout, Kernels, TAIL_COUNTERS, TAIL_NONE, TailMode};
use rand::{Rng, rngs::StdRng};
use std::sync::Arc;

const LAYERS: usize = 24;
const E: usize = 128;
const TOPK: usize = 8;
const TAIL: usize = 384;
/// Experts `0..HOT` of every layer are resident (VRAM), the rest cold.
const HOT: usize = 64;
/// Launches per timed graph: each layer's cold experts recur only after
/// every other layer's (1,536 launches), far more promotions than the
/// tail has slots.
const LAUNCHES: usize = LAYERS * (E - HOT);

/// The tail's device state (layout in `cuda/expert_tail.cu`), reset to
/// "nothing promoted" before each measurement.
struct State {
    table: CudaSlice<u64>,
    host: CudaSlice<u64>,
    home: CudaSlice<u64>,
    tail_of: CudaSlice<u32>,
    owner: CudaSlice<u32>,
    stamp: CudaSlice<u32>,
    pending: CudaSlice<u32>,
    slot: CudaSlice<u64>,
    clock: CudaSlice<u32>,
    fetch: CudaSlice<u64>,
    n_fetch: CudaSlice<u32>,
    counters: CudaSlice<u64>,
    table0: Vec<u64>,
    host0: Vec<u64>,
}

impl State {
    fn reset(&mut self, s: &Arc<CudaStream>) -> anyhow::Result<()> {
        s.memcpy_htod(&self.table0, &mut self.table)?;
        s.memcpy_htod(&self.host0, &mut self.host)?;
        s.memcpy_htod(&self.host0, &mut self.home)?;
        s.memcpy_htod(&vec![TAIL_NONE; LAYERS * E], &mut self.tail_of)?;
        s.memcpy_htod(&vec![TAIL_NONE; TAIL], &mut self.owner)?;
        s.memset_zeros(&mut self.stamp)?;
        s.memset_zeros(&mut self.pending)?;
        s.memset_zeros(&mut self.clock)?;
        s.memset_zeros(&mut self.counters)?;
        Ok(())
    }

    fn args(&self, s: &Arc<CudaStream>, expert_bytes: usize) -> ExpertTail {
        let a64 = |b: &CudaSlice<u64>| b.device_ptr(s).0;
        let a32 = |b: &CudaSlice<u32>| b.device_ptr(s).0;
        ExpertTail {
            table: a64(&self.table),
            host: a64(&self.host),
            home: a64(&self.home),
            tail_of: a32(&self.tail_of),
            owner: a32(&self.owner),
            stamp: a32(&self.stamp),
            pending: a32(&self.pending),
            slot: a64(&self.slot),
            clock: a32(&self.clock),
            fetch: a64(&self.fetch),
            n_fetch: a32(&self.n_fetch),
            counters: a64(&self.counters),
            layers: LAYERS,
            experts: E,
            tail: TAIL,
            top_k: TOPK,
            max_pairs: TOPK,
            expert_bytes,
        }
    }
}

/// Launch `n`'s route: layer `n % 24`, `j` cold experts (never recurring
/// within [`LAUNCHES`] / 2 launches), the rest drawn from the resident ones.
fn routes(rng: &mut StdRng, j: usize) -> Vec<u32> {
    let mut ids = Vec::with_capacity(LAUNCHES * TOPK);
    for n in 0..LAUNCHES {
        let c = n / LAYERS;
        let mut row: Vec<u32> = (0..j)
            .map(|q| (HOT + (c * j + q) % (E - HOT)) as u32)
            .collect();
        while row.len() < TOPK {
            let e = rng.random_range(0..HOT) as u32;
            if !row.contains(&e) {
                row.push(e);
            }
        }
        ids.extend(row);
    }
    ids
}

pub fn bench_tail(
    k: &Kernels,
    s: &Arc<CudaStream>,
    rng: &mut StdRng,
    rows: &mut Vec<String>,
) -> anyhow::Result<()> {
    let (h, i) = (2048usize, 768usize);
    let layout = Int4Layout::new(h, i, 128).context("INT4 layout")?;
    let stride = layout.used_bytes().div_ceil(4096) * 4096;
    // Resident experts: a pool of 128 distinct blocks in VRAM (more than
    // L2 holds), cold ones: 256 in mapped host memory.
    let (n_dev, n_host) = (128usize, 256usize);
    let mut bytes = vec![0u8; n_dev * stride];
    fill_experts(rng, &layout, stride, &mut bytes);
    let dev: CudaSlice<u8> = s.clone_htod(&bytes)?;
    drop(bytes);
    let mut pool = Mapped::new(n_host * stride)?;
    fill_experts(rng, &layout, stride, pool.bytes());
    let slots: CudaSlice<u8> = s.alloc_zeros(TAIL * stride)?;
    let (db, sb) = (dev.device_ptr(s).0, slots.device_ptr(s).0);
    let mut table0 = Vec::with_capacity(LAYERS * E);
    let mut host0 = Vec::with_capacity(LAYERS * E);
    for l in 0..LAYERS {
        for e in 0..E {
            let h_at = pool.dev + (((l * E + e) % n_host) * stride) as u64;
            host0.push(h_at);
            table0.push(if e < HOT {
                db + (((l * HOT + e) % n_dev) * stride) as u64
            } else {
                h_at
            });
        }
    }
    let mut st = State {
        table: s.clone_htod(&table0)?,
        host: s.clone_htod(&host0)?,
        home: s.clone_htod(&host0)?,
        tail_of: s.alloc_zeros(LAYERS * E)?,
        owner: s.alloc_zeros(TAIL)?,
        stamp: s.alloc_zeros(TAIL)?,
        pending: s.alloc_zeros(TAIL)?,
        slot: s.clone_htod(
            &(0..TAIL)
                .map(|t| sb + (t * stride) as u64)
                .collect::<Vec<_>>(),
        )?,
        clock: s.alloc_zeros(1)?,
        fetch: s.alloc_zeros(2 * TOPK)?,
        n_fetch: s.alloc_zeros(1)?,
        counters: s.alloc_zeros(TAIL_COUNTERS)?,
        table0,
        host0,
    };
    let args = st.args(s, stride);
    let xb = s.clone_htod(&super::rand_bf16(rng, h))?;
    let w = s.clone_htod(&vec![0.125f32; TOPK])?;
    let mut act = s.alloc_zeros::<f32>(TOPK * i)?;
    let mut resd = s.alloc_zeros::<f32>(h)?;
    rows.push(format!(
        "a3b one MoE layer, 1 row, tail {TAIL}: us per layer (graph-timed, {LAUNCHES} launches \
         over {LAYERS} layers); counters per launch: hits / promoted / read in place"
    ));
    #[derive(Clone, Copy, PartialEq)]
    enum Part {
        Gemv,
        Lookup,
        LookupFetch,
        Step,
    }
    for j in [0usize, 1, 2] {
        let ids = s.clone_htod(&routes(rng, j))?;
        let mut line = format!("cold {j}:");
        for (name, part) in [
            ("gemv", Part::Gemv),
            ("lookup", Part::Lookup),
            ("lookup+fetch", Part::LookupFetch),
            ("step", Part::Step),
        ] {
            if part == Part::Gemv && j > 0 {
                continue; // the GEMVs would read the cold experts in place
            }
            st.reset(s)?;
            let us = 1e3
                * time_graph_ms(s, LAUNCHES, |n| {
                    let n = n % LAUNCHES;
                    let l = n % LAYERS;
                    let id = ids.slice(n * TOPK..(n + 1) * TOPK);
                    if part != Part::Gemv {
                        k.tail_lookup(s, &args, l, &id, TOPK, TailMode::Demand)?;
                    }
                    if matches!(part, Part::LookupFetch | Part::Step) {
                        k.tail_fetch(s, &args)?;
                    }
                    if matches!(part, Part::Gemv | Part::Step) {
                        let table = st.table.slice(l * E..(l + 1) * E);
                        k.int4_w13_swiglu(
                            s,
                            &xb,
                            &table,
                            &id,
                            1,
                            TOPK,
                            &layout,
                            u32::MAX,
                            true,
                            &mut act,
                        )?;
                        k.int4_w2_combine(s, &act, &table, &id, &w, 1, TOPK, &layout, &mut resd)?;
                    }
                    Ok(())
                })?;
            let c = s.clone_dtoh(&st.counters)?;
            let per = |x: u64| x as f64 / c[0].max(1) as f64 * TOPK as f64;
            line.push_str(&format!(
                "  {name} {us:>6.2}{}",
                if part == Part::Gemv {
                    String::new()
                } else {
                    format!(" ({:.2}/{:.2}/{:.2})", per(c[1]), per(c[2]), per(c[3]))
                }
            ));
        }
        rows.push(line);
    }
    drop(pool);
    Ok(())
}
