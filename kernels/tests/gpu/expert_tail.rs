//! `expert_tail` (lookup, LRU promotion and fetch; demand and prefetch
//! launches) against its CPU reference over random decode steps: the
//! device state equals the reference's exactly after every launch, and
//! every expert's table entry names bytes equal to the expert's block (in a
//! tail slot, a resident buffer or mapped page-locked host memory), which
//! is what decode exactness depends on. Midway, two chunks of a "prior"
//! land (`tail_home`, as a reload after prefill does on the copy stream):
//! their experts become hits through their new slots, a tail slot still
//! holding one is freed at its next hit, and one evicted from the tail
//! first points back at its prior slot, not its host bytes.

use cudarc::driver::{CudaSlice, DevicePtr, sys};
use krasis_kernels::{
    ExpertTail, TABLE_FRESH, TAIL_COUNTERS, TAIL_NONE, TailMode, reference::TailState,
};
use rand::Rng;
use rand::seq::SliceRandom;

use crate::common::*;

/// MoE layers, experts per layer, tail slots, expert block bytes (a
/// multiple of 16, not a power of two), experts per row.
const L: usize = 3;
const E: usize = 16;
const T: usize = 5;
const BYTES: usize = 4096 + 16 * 7;
const TOP_K: usize = 4;
const MAX_PAIRS: usize = 4 * TOP_K;

#[test]
fn expert_tail_matches_reference() {
    let name = "expert_tail_matches_reference";
    let Some((g, s)) = gpu(name) else {
        return;
    };
    let mut rng = rng(name);
    let experts: Vec<Vec<u8>> = (0..L * E)
        .map(|_| (0..BYTES).map(|_| rng.random::<u8>()).collect())
        .collect();
    g.ctx.bind_to_thread().unwrap();
    let mapped = MappedHost::new(&experts.concat());
    let host: Vec<u64> = (0..L * E)
        .map(|k| mapped.dev + (k * BYTES) as u64)
        .collect();
    // Three resident experts per layer, copied to device memory.
    let mut resident_keys = Vec::new();
    for l in 0..L {
        let mut ids: Vec<usize> = (0..E).collect();
        ids.shuffle(&mut rng);
        resident_keys.extend(ids[..3].iter().map(|&e| l * E + e));
    }
    let resident_bytes: Vec<u8> = resident_keys
        .iter()
        .flat_map(|&k| experts[k].clone())
        .collect();
    let resident = up(&s, &resident_bytes);
    let slots = up(&s, &vec![0xFFu8; T * BYTES]);
    let addr8 = |b: &CudaSlice<u8>| b.device_ptr(&s).0;
    let (res_base, slot_base) = (addr8(&resident), addr8(&slots));
    let mut table = host.clone();
    for (j, &k) in resident_keys.iter().enumerate() {
        table[k] = res_base + (j * BYTES) as u64;
    }
    let slot_addr: Vec<u64> = (0..T).map(|i| slot_base + (i * BYTES) as u64).collect();

    let table_d = up(&s, &table);
    let host_d = up(&s, &host);
    let home_d = up(&s, &table);
    let tail_of_d = up(&s, &[TAIL_NONE; L * E]);
    let owner_d = up(&s, &[TAIL_NONE; T]);
    let stamp_d = up(&s, &[0u32; T]);
    let pending_d = up(&s, &[0u32; T]);
    let slot_d = up(&s, &slot_addr);
    let clock_d = up(&s, &[0u32]);
    let fetch_d = up(&s, &[0u64; 2 * MAX_PAIRS]);
    let n_fetch_d = up(&s, &[0u32]);
    let pf_fetch_d = up(&s, &[0u64; 2 * MAX_PAIRS]);
    let pf_n_fetch_d = up(&s, &[0u32]);
    let counters_d = up(&s, &[0u64; TAIL_COUNTERS]);
    let a64 = |b: &CudaSlice<u64>| b.device_ptr(&s).0;
    let a32 = |b: &CudaSlice<u32>| b.device_ptr(&s).0;
    let tail = ExpertTail {
        table: a64(&table_d),
        host: a64(&host_d),
        home: a64(&home_d),
        tail_of: a32(&tail_of_d),
        owner: a32(&owner_d),
        stamp: a32(&stamp_d),
        pending: a32(&pending_d),
        slot: a64(&slot_d),
        clock: a32(&clock_d),
        fetch: a64(&fetch_d),
        n_fetch: a32(&n_fetch_d),
        counters: a64(&counters_d),
        layers: L,
        experts: E,
        tail: T,
        top_k: TOP_K,
        max_pairs: MAX_PAIRS,
        expert_bytes: BYTES,
    };
    // Prefetch launches write their own fetch list (as the runtime's do).
    let pf_tail = ExpertTail {
        fetch: a64(&pf_fetch_d),
        n_fetch: a32(&pf_n_fetch_d),
        ..tail
    };
    let mut want = TailState::new(E, TOP_K, table, host.clone(), slot_addr.clone());
    // What the slot buffer must hold: the fetch lists applied in order.
    let mut want_slots = vec![0xFFu8; T * BYTES];

    // Refused without a launch: no pairs, more pairs than the fetch list
    // holds (with an ids buffer long enough), a part of a row, a layer past
    // the last.
    let ids_big = up(&s, &[0u32; MAX_PAIRS + TOP_K]);
    let k = &g.kernels;
    let demand = TailMode::Demand;
    let e = k
        .tail_lookup(&s, &tail, 0, &ids_big, 0, demand)
        .unwrap_err();
    assert!(e.to_string().contains("0 pairs"), "{e}");
    let e = k
        .tail_lookup(&s, &tail, 0, &ids_big, MAX_PAIRS + TOP_K, demand)
        .unwrap_err();
    assert!(
        e.to_string()
            .contains(&format!("{} pairs", MAX_PAIRS + TOP_K)),
        "{e}"
    );
    let e = k
        .tail_lookup(&s, &tail, 0, &ids_big, TOP_K + 1, demand)
        .unwrap_err();
    assert!(e.to_string().contains("whole rows"), "{e}");
    let e = k
        .tail_lookup(&s, &tail, L, &ids_big, TOP_K, demand)
        .unwrap_err();
    assert!(e.to_string().contains("MoE layer"), "{e}");
    sync(&s);
    assert_eq!(down(&s, &clock_d), [0], "a refused call launched");
    assert_eq!(
        down(&s, &counters_d),
        [0; TAIL_COUNTERS],
        "a refused call launched"
    );
    assert!(down(&s, &slots) == want_slots, "a refused call fetched");

    // Per layer, its three resident experts and three others: the first of
    // them makes hot steps fit the tail, all three overflow it.
    let favourites: Vec<Vec<u32>> = (0..L)
        .map(|l| {
            let mut f: Vec<u32> = (0..E as u32)
                .filter(|&e| !resident_keys.contains(&(l * E + e as usize)))
                .collect();
            f.shuffle(&mut rng);
            f.truncate(3);
            resident_keys[l * 3..l * 3 + 3]
                .iter()
                .map(|&k| (k - l * E) as u32)
                .chain(f)
                .collect()
        })
        .collect();
    // The prior: two favourites of each layer that are not resident, in
    // device memory of their own, pointed at in two chunks (steps 12, 31).
    let prior_keys: Vec<usize> = (0..L)
        .flat_map(|l| favourites[l][3..5].iter().map(move |&e| l * E + e as usize))
        .collect();
    let prior_bytes: Vec<u8> = prior_keys
        .iter()
        .flat_map(|&k| experts[k].clone())
        .collect();
    let prior = up(&s, &prior_bytes);
    let prior_base = addr8(&prior);
    let prior_list: Vec<u64> = prior_keys
        .iter()
        .enumerate()
        .flat_map(|(j, &k)| [k as u64, prior_base + (j * BYTES) as u64])
        .collect();
    let prior_list_d = up(&s, &prior_list);
    let half = prior_keys.len() / 2;
    let (mut tail_hits, mut resident_hits, mut evictions) = (0usize, 0usize, 0usize);
    let (mut prior_hits, mut back_to_prior, mut freed) = (0usize, 0usize, 0usize);
    let mut launches = 0usize;
    // Rows of TOP_K distinct experts drawn from `pool` (or, `wide`, all 16
    // experts once).
    let draw = |rng: &mut rand::rngs::StdRng, pool: &[u32], rows: usize, wide: bool| {
        if wide {
            let mut all = pool.to_vec();
            all.shuffle(rng);
            return all;
        }
        (0..rows)
            .flat_map(|_| {
                let mut r = pool.to_vec();
                r.shuffle(rng);
                r.truncate(TOP_K);
                r
            })
            .collect::<Vec<u32>>()
    };
    for step in 0..60 {
        let landed = match step {
            12 => 0..half,
            31 => half..prior_keys.len(),
            _ => 0..0,
        };
        if !landed.is_empty() {
            let list = a64(&prior_list_d) + (landed.start * 16) as u64;
            k.tail_home(&s, &tail, list, landed.len())
                .unwrap_or_else(|e| panic!("step {step}: tail_home: {e}"));
            for j in landed {
                want.set_home(prior_keys[j], prior_list[2 * j + 1]);
            }
            sync(&s);
            assert_eq!(
                down(&s, &table_d),
                want.table,
                "step {step}: tail_home table"
            );
            assert_eq!(down(&s, &home_d), want.home, "step {step}: tail_home home");
        }
        // Steps 0-2 of every ten are hot (each layer routes to its residents
        // and one favourite: 3 tail keys in all, so the next hot step hits),
        // 3-4 warm (residents and three favourites: repeats, evictions),
        // 5-8 uniform and 9 wide (all 16 experts: more distinct misses than
        // the tail holds, so some are read in place).
        let kind = step % 10;
        let rows = if kind == 9 {
            4
        } else {
            rng.random_range(1..=4)
        };
        let n = rows * TOP_K;
        let pool = |l: usize| -> Vec<u32> {
            match kind {
                0..=2 => favourites[l][..4].to_vec(),
                3..=4 => favourites[l].clone(),
                _ => (0..E as u32).collect(),
            }
        };
        for layer in 0..L {
            // The layer's demand lookup, then (on odd steps, as the runtime
            // does between layers) a prefetch of the next layer's guess:
            // the next layer's own pool, or any experts, capped at 1-4.
            let mut run = vec![(layer, draw(&mut rng, &pool(layer), rows, kind == 9), demand)];
            if step % 2 == 1 && layer + 1 < L {
                let guess = match rng.random_range(0..2) {
                    0 => pool(layer + 1),
                    _ => (0..E as u32).collect(),
                };
                let max = rng.random_range(1..=4);
                run.push((
                    layer + 1,
                    draw(&mut rng, &guess, rows, false),
                    TailMode::Prefetch { max },
                ));
            }
            for (layer, ids, mode) in run {
                assert_eq!(ids.len(), n);
                let what = format!("step {step} layer {layer} {mode:?} ids {ids:?}");
                let keys: Vec<usize> = ids.iter().map(|&e| layer * E + e as usize).collect();
                if mode == demand {
                    tail_hits += keys
                        .iter()
                        .filter(|&&k| want.tail_of[k] != TAIL_NONE)
                        .count();
                    resident_hits += keys.iter().filter(|k| resident_keys.contains(k)).count();
                    let mut stale: Vec<usize> = keys
                        .iter()
                        .copied()
                        .filter(|&k| {
                            let t = want.tail_of[k];
                            t != TAIL_NONE && want.table[k] & !TABLE_FRESH != want.slot[t as usize]
                        })
                        .collect();
                    stale.sort_unstable();
                    stale.dedup();
                    freed += stale.len();
                    prior_hits += keys
                        .iter()
                        .filter(|&&k| {
                            let a = want.table[k] & !TABLE_FRESH;
                            want.tail_of[k] == TAIL_NONE
                                && (prior_base..prior_base + prior_bytes.len() as u64).contains(&a)
                        })
                        .count();
                }
                let owner_before = want.owner.clone();
                let (t, fetch_d, n_fetch_d) = match mode {
                    TailMode::Demand | TailMode::DemandUnmarked => (&tail, &fetch_d, &n_fetch_d),
                    TailMode::Prefetch { .. } => (&pf_tail, &pf_fetch_d, &pf_n_fetch_d),
                };

                let ids_d = up(&s, &ids);
                k.tail_lookup(&s, t, layer, &ids_d, n, mode)
                    .and_then(|_| k.tail_fetch(&s, t))
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                sync(&s);
                launches += 1;
                let fetch = want.launch(layer, &ids, mode);
                for &(h, sl) in &fetch {
                    let i = ((sl - slot_base) as usize) / BYTES;
                    let old = owner_before[i];
                    evictions += (old != TAIL_NONE) as usize;
                    back_to_prior += (old != TAIL_NONE
                        && want.home[old as usize] != host[old as usize])
                        as usize;
                    let k = ((h - mapped.dev) as usize) / BYTES;
                    want_slots[i * BYTES..(i + 1) * BYTES].copy_from_slice(&experts[k]);
                }

                assert_eq!(down(&s, &table_d), want.table, "{what}: table");
                assert_eq!(down(&s, &home_d), want.home, "{what}: home");
                assert_eq!(down(&s, &tail_of_d), want.tail_of, "{what}: tail_of");
                assert_eq!(down(&s, &owner_d), want.owner, "{what}: owner");
                assert_eq!(down(&s, &stamp_d), want.stamp, "{what}: stamp");
                assert_eq!(down(&s, &pending_d), want.pending, "{what}: pending");
                assert_eq!(down(&s, &clock_d), [want.clock], "{what}: clock");
                assert_eq!(want.clock as usize, launches, "{what}: reference clock");
                assert_eq!(down(&s, &counters_d), want.counters, "{what}: counters");
                assert_eq!(down(&s, n_fetch_d), [fetch.len() as u32], "{what}: n_fetch");
                let got_fetch = down(&s, fetch_d);
                let want_fetch: Vec<u64> = fetch.iter().flat_map(|&(h, sl)| [h, sl]).collect();
                assert_eq!(
                    got_fetch[..want_fetch.len()],
                    want_fetch[..],
                    "{what}: fetch"
                );
                assert_eq!(down(&s, &host_d), host, "{what}: host addresses");
                assert_eq!(down(&s, &slot_d), slot_addr, "{what}: slot addresses");

                // Every table entry names the expert's bytes (a fresh one
                // once its fetch has run, as here): this launch's pairs
                // first (what the GEMVs read next), then all the others.
                let got_slots = down(&s, &slots);
                assert!(got_slots == want_slots, "{what}: slot buffer");
                assert!(
                    down(&s, &resident) == resident_bytes,
                    "{what}: resident buffer"
                );
                let bytes_at = |a: u64| -> &[u8] {
                    let within = |base: u64, len: usize| {
                        (a >= base && a < base + len as u64).then(|| {
                            let off = (a - base) as usize;
                            assert_eq!(off % BYTES, 0, "{what}: {a:#x} is not a block start");
                            off
                        })
                    };
                    if let Some(o) = within(slot_base, T * BYTES) {
                        &got_slots[o..o + BYTES]
                    } else if let Some(o) = within(res_base, resident_bytes.len()) {
                        &resident_bytes[o..o + BYTES]
                    } else if let Some(o) = within(prior_base, prior_bytes.len()) {
                        &prior_bytes[o..o + BYTES]
                    } else if let Some(o) = within(mapped.dev, L * E * BYTES) {
                        &mapped.bytes()[o..o + BYTES]
                    } else {
                        panic!("{what}: table entry {a:#x} points outside every buffer")
                    }
                };
                let got_table = down(&s, &table_d);
                for &k in keys.iter().chain(&(0..L * E).collect::<Vec<_>>()) {
                    assert!(
                        bytes_at(got_table[k] & !TABLE_FRESH) == experts[k],
                        "{what}: key {k} at {:#x} does not hold the expert's bytes",
                        got_table[k]
                    );
                }
            }
        }
    }
    let c = want.counters;
    eprintln!(
        "{name}: {launches} launches, counters {c:?}, tail hits {tail_hits}, resident hits \
         {resident_hits}, evictions {evictions}, prior hits {prior_hits}, tail slots freed \
         at a hit through the prior {freed}, evicted back to their prior slot {back_to_prior}"
    );
    assert!(prior_hits > 0, "no hit through a landed prior slot");
    assert!(
        freed + back_to_prior > 0,
        "no landed expert left the tail (freed at a hit or evicted to its prior slot)"
    );
    assert!(
        down(&s, &prior) == prior_bytes,
        "the prior buffer was written"
    );
    assert!(tail_hits > 0, "no tail hit: {c:?}");
    assert!(resident_hits > 0, "no resident hit: {c:?}");
    assert!(c[2] > 0, "no promotion: {c:?}");
    assert!(evictions > 0, "no eviction: {c:?}");
    assert!(c[3] > 0, "nothing read in place: {c:?}");
    assert_eq!(
        c[1] as usize,
        tail_hits + resident_hits + prior_hits,
        "hits"
    );
    assert!(c[5] > 0, "nothing prefetched: {c:?}");
    assert!(c[6] > 0, "no prefetch used: {c:?}");
    assert!(c[7] > 0, "no prefetch wasted: {c:?}");
}

/// Page-locked host memory mapped into the device, holding `data`; freed
/// on drop.
struct MappedHost {
    host: *mut u8,
    dev: u64,
    len: usize,
}

impl MappedHost {
    fn new(data: &[u8]) -> Self {
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: fresh allocation, filled before any device access.
        let host =
            unsafe { cudarc::driver::result::malloc_host(data.len(), flags) }.unwrap() as *mut u8;
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), host, data.len()) };
        let mut dev = 0;
        // SAFETY: allocated with DEVICEMAP above.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host as *mut _, 0) }
            .result()
            .unwrap();
        MappedHost {
            host,
            dev,
            len: data.len(),
        }
    }

    /// The bytes as the device sees them (read after a synchronize).
    fn bytes(&self) -> &[u8] {
        // SAFETY: `len` bytes allocated in `new`, alive until drop.
        unsafe { std::slice::from_raw_parts(self.host, self.len) }
    }
}

impl Drop for MappedHost {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host in `new`, freed once.
        unsafe { cudarc::driver::result::free_host(self.host as *mut _) }.unwrap();
    }
}
