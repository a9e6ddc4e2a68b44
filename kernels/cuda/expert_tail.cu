// HCS decode: the recency tail of the GPU expert cache, kept and filled on
// the device.
//
// Why here: a decode step under a VRAM limit routes to experts that have no
// slot. Resolving that on the host cost a round trip per MoE layer (the
// router's ids down, copies issued, ~25 us each on the H200) and kept the
// step out of a CUDA graph. Reading every cold expert in place from mapped
// host memory removed the round trip but cached nothing, and consecutive
// tokens reuse experts: on a3b-24l at 6 GiB the hit rate fell from 0.88 to
// 0.60 and decode from 305 to 170 tok/s (session 8). So the lookup and a
// plain LRU promotion (white paper F08/F10: promotion small and dumb) run
// after each router, and streaming multiprocessors copy the promoted
// experts from mapped page-locked host memory (45-51 GB/s measured).
//
// State, device memory owned by the runtime (`hcs/tail.rs`); a key is
// moe_layer * E + expert:
//   table[L*E]    the expert pointer table the GEMVs read: a slot's address
//                 (resident, prior or tail) or the expert's mapped host
//                 bytes; bit 0 (TABLE_FRESH, common.cuh) marks a tail slot
//                 this step's lookup promoted, whose copy may still run
//   host[L*E]     each expert's mapped host address
//   home[L*E]     where the key's table entry returns when the tail evicts
//                 it: its mapped host bytes, or the prior slot a reload has
//                 filled since (tail_home)
//   tail_of[L*E]  the tail slot holding the key, or NONE
//   owner[T]      the key a tail slot holds, or NONE
//   stamp[T]      clock of the slot's last use (0: never used)
//   pending[T]    1: filled by a prefetch and not yet used by a demand lookup
//   slot[T]       the tail slots' device addresses
//   clock[1]      +1 per lookup launch
//   fetch[2*P], n_fetch[1]: this launch's copies, (host, slot) address pairs
//                 (a prefetch launch has its own list)
//   counters[8]   cumulative: pairs looked up, pairs that hit a slot, experts
//                 promoted (copied), pairs read in place (demand launches);
//                 pairs predicted, experts prefetched, prefetched experts a
//                 demand lookup then used, prefetched experts evicted unused
//
// tail_lookup (one block of 256 threads; one MoE layer's P = rows * top_k
// pairs, P <= 256; T <= TAIL_MAX_SLOTS), in one of two modes.
// Demand (after the layer's router; its GEMVs run next):
//   1. clock += 1. A pair hits when table[key] != host[key] (fresh bit
//      cleared first: an earlier step's copy has landed); a tail hit
//      stamps its slot with the clock (and a pending slot counts as a useful
//      prefetch). A hit whose table entry is not its tail slot (its prior
//      slot landed meanwhile, tail_home) frees that tail slot instead.
//   2. The layer's distinct missing experts, rank-major (every row's first
//      choice, then every row's second, ...), each take the least recently
//      stamped tail slot (ties: lowest index) whose stamp is not this
//      launch's clock, so never a slot an expert of this launch uses. The
//      slot's previous owner points back at its home, the new key at the
//      slot (marked fresh), and (host, slot) joins the fetch list.
//   3. A missing expert with no such slot (every slot used by this launch,
//      or no tail) keeps its host address: the GEMVs read it in place.
// Prefetch (the next MoE layer's predicted experts, on a side stream while
// this layer's GEMVs and the next layer's attention run on the compute
// stream; the next demand lookup waits for it, `hcs/tail.rs`):
//   the same, except that hits only stamp, at most `max_promote` misses are
//   promoted (the best-ranked first), a miss with no slot is left alone, the
//   slots the previous launch stamped are excluded too (that launch is the
//   demand lookup whose GEMVs may be reading them concurrently), and the
//   promoted slots are stamped 1 when the launch ends: a guess enters the
//   LRU order at its old end, so a wrong one is the next victim instead of
//   pushing out experts that are still in use (inserted as most recent, the
//   first version's wrong guesses cut the tail's reuse: a3b-24l at 6 GiB
//   needed 28.7 cold experts per token against 19.0 without prefetch). A
//   demand hit then stamps it like any other slot.
//   Exactness does not depend on any of these choices: once tail_fetch has
//   run (stream order) every pointer names bytes equal to the expert's
//   cache block, so decode is bit-identical to all resident. A prefetch
//   rewrites only table entries of keys no concurrent GEMV reads (the
//   layer it predicts, and evicted keys, whose slots the running launch did
//   not stamp).
// Cost (kbench --tail, H200, a3b, one row, tail 384; session 14): the
//   first version took 2.99 us with no miss and +1.5 us per miss (now 2.07
//   and +0.7-1.4, launched as the router's programmatic dependent), most of
//   it dependent global loads in series (clock, then ids -> table -> tail_of
//   -> slot, then a 384-stamp scan from global memory per miss, then the
//   counters read-modify-written). So every independent load is issued at
//   once (stamps into shared memory; "not its tail slot" is read as "its
//   table entry is its home", which needs no slot load), the per-miss
//   rounds scan shared memory and only pick victims, the promotions then
//   run one thread per miss, and the counters are fire-and-forget atomics.
// Overlap (session 14): the copies of a layer's misses used to run between
//   its lookup and its GEMVs, in series with both (one cold a3b expert: 51
//   us of copy, the GEMVs 15 us; the whole layer step 70.7 us, now 66.3).
//   tail_fetch now launches as a programmatic
//   dependent of tail_lookup and the w13 GEMV as one of tail_fetch; fresh
//   table entries make just the threads that read a promoted expert wait
//   for the copy (`table_entry`, common.cuh), so the layer's resident and
//   tail-hit experts are computed while the misses are copied.
// tail_fetch (any grid of 256-thread blocks): copies the fetch list as
//   16-byte vectors, each expert's vectors spread over the whole grid.
// tail_home (on the copy stream, after a chunk of the prior's reload has
//   landed): home[key] = table[key] = the chunk's slots. Decode runs while
//   the prior reloads after a prefill (`hcs/mod.rs`); until its chunk lands
//   a prior expert is a miss like any other. The launch races with the
//   compute stream's lookups, and every interleaving is exact: the table
//   only ever receives the expert's host bytes, its tail slot (written
//   before tail_fetch, which precedes any GEMV in stream order) or its
//   landed prior slot, and each holds the expert's bytes for as long as a
//   kernel may read it (a prior slot until the next prefill, which waits
//   for the reload before it lends the tier). tail_home touches no tail
//   state, so the tail's own bookkeeping stays consistent; an expert the
//   tail holds when its prior slot lands keeps its tail slot until evicted,
//   then returns to the prior slot through home. A lookup that read home
//   just before it changed sends an evicted key to its host bytes: slower
//   until the next prefill, still exact.
// The CPU reference is `reference/expert_tail.rs`.

#define TAIL_NONE 0xffffffffu
#define TAIL_MAX_PAIRS 256
#define TAIL_MAX_SLOTS 8192

extern "C" __global__ void __launch_bounds__(256)
    tail_lookup(u64* __restrict__ table, const u64* __restrict__ host,
                const u64* home,  // no __restrict__: tail_home writes it from another stream
                u32* __restrict__ tail_of,
                u32* __restrict__ owner, u32* __restrict__ stamp, u32* __restrict__ pending,
                const u64* __restrict__ slot, u32* __restrict__ clock, u64* __restrict__ fetch,
                u32* __restrict__ n_fetch, u64* __restrict__ counters, const u32* __restrict__ ids,
                u32 n_pairs, u32 layer, u32 experts, u32 tail, u32 top_k, u32 mode,
                u32 max_promote) {
    __shared__ u32 s_stamp[TAIL_MAX_SLOTS];
    __shared__ u32 s_key[TAIL_MAX_PAIRS];
    __shared__ unsigned char s_hit[TAIL_MAX_PAIRS];
    __shared__ u32 s_miss[TAIL_MAX_PAIRS];
    __shared__ u32 s_pairs[TAIL_MAX_PAIRS];
    __shared__ u32 s_victim[TAIL_MAX_PAIRS];
    __shared__ u32 s_at[TAIL_MAX_PAIRS];  // a promoted miss's place in the fetch list
    __shared__ u32 s_warp_stamp[8], s_warp_idx[8];
    __shared__ u32 s_now, s_n_miss, s_useful, s_fetched;
    // tail_fetch, launched as a programmatic dependent, may get scheduled
    // now; it waits for this grid before it reads the fetch list.
    pdl_trigger();
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // mode 0: demand, 1: prefetch, 2: demand whose promotions are not
    // marked fresh (`Fault::UnmarkedFetch`, tests only: the GEMVs then read
    // the slots while their copies still run).
    const bool prefetch = mode == 1, mark = mode == 0;
    // 1. Every independent load at once: the clock, the slots' stamps (into
    //    shared memory: the promotion rounds below scan them once per miss)
    //    and each pair's table, host, home and tail entries. The clock and
    //    stamps only lookups write, and every earlier lookup has completed
    //    (a normal launch, the router's, lies between), so they are read
    //    while the router, whose programmatic dependent this launch is on
    //    sm_90, still runs; the ids after it has completed.
    u32 clk = 0;
    if (tid == 0) clk = clock[0];
    for (u32 t = tid; t < tail; t += blockDim.x) s_stamp[t] = stamp[t];
    pdl_wait();
    u32 key = 0, tk = TAIL_NONE;
    u64 at = 0, hm = 0;
    bool hit = false;
    if (tid < n_pairs) {
        const u32 e = ids[tid];
        if (e >= experts) asm volatile("trap;");
        key = layer * experts + e;
        const u64 raw = table[key];
        at = raw & ~TABLE_FRESH;
        // Promoted by an earlier step: its copy has long landed.
        if (raw != at) table[key] = at;
        const u64 hs = host[key];
        hm = home[key];
        tk = tail_of[key];
        hit = at != hs;
        s_key[tid] = key;
        s_hit[tid] = hit;
    }
    if (tid == 0) {
        s_now = clk + 1;
        clock[0] = clk + 1;
        s_useful = 0;
    }
    __syncthreads();
    const u32 now = s_now;
    // A prefetch also spares the previous launch's slots (0: never used).
    const u32 spared = prefetch && now > 1 ? now - 1 : now;
    if (hit && tk != TAIL_NONE) {
        if (at == hm) {
            // Its prior slot landed while the tail held it (tail_home set
            // home and table to it; home is never a tail slot, so this is
            // "table entry != its tail slot"): nothing reads the tail slot
            // any more, so it is free at once (kept, a hot expert's hits
            // would keep it most recent and out of use for the whole
            // decode). Seen half-written (table moved, home not yet), it is
            // a tail hit this time: still exact.
            owner[tk] = TAIL_NONE;
            tail_of[key] = TAIL_NONE;
            stamp[tk] = 0;
            s_stamp[tk] = 0;
            if (atomicExch(&pending[tk], 0u) != 0u) atomicAdd((unsigned long long*)&counters[7], 1ull);
        } else {
            stamp[tk] = now;
            s_stamp[tk] = now;
            // Several rows may hit one slot: count it once.
            if (!prefetch && atomicExch(&pending[tk], 0u) != 0u) atomicAdd(&s_useful, 1u);
        }
    }
    __syncthreads();
    if (tid == 0) {
        const u32 rows = n_pairs / top_k;
        u32 n = 0, hits = 0;
        for (u32 q = 0; q < n_pairs; ++q) {
            const u32 p = (q % rows) * top_k + q / rows;  // rank-major
            if (s_hit[p]) {
                ++hits;
                continue;
            }
            u32 j = 0;
            while (j < n && s_miss[j] != s_key[p]) ++j;
            if (j == n) {
                s_miss[n] = s_key[p];
                s_pairs[n] = 0;
                ++n;
            }
            ++s_pairs[j];
        }
        s_n_miss = prefetch ? min(n, max_promote) : n;
        // Fire-and-forget reductions: nothing here waits for them.
        if (prefetch) {
            atomicAdd(&counters[4], (u64)n_pairs);
        } else {
            atomicAdd(&counters[0], (u64)n_pairs);
            atomicAdd(&counters[1], (u64)hits);
            if (s_useful) atomicAdd(&counters[6], (u64)s_useful);
        }
        s_fetched = 0;
    }
    __syncthreads();
    // 2. Victims, one round per distinct miss in rank-major order: the
    //    least recently stamped slot not used by this launch (nor, for a
    //    prefetch, by the previous one), ties to the lowest index; taken
    //    slots are stamped `now` here so later rounds skip them.
    const u32 nm = s_n_miss;
    for (u32 m = 0; m < nm; ++m) {
        u32 best_s = TAIL_NONE, best_i = TAIL_NONE;
        for (u32 t = tid; t < tail; t += blockDim.x) {
            const u32 s = s_stamp[t];
            if (s != now && s != spared && s < best_s) {
                best_s = s;
                best_i = t;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const u32 os = __shfl_down_sync(0xffffffffu, best_s, o);
            const u32 oi = __shfl_down_sync(0xffffffffu, best_i, o);
            if (os < best_s || (os == best_s && oi < best_i)) {
                best_s = os;
                best_i = oi;
            }
        }
        if (lane == 0) {
            s_warp_stamp[warp] = best_s;
            s_warp_idx[warp] = best_i;
        }
        __syncthreads();
        if (tid == 0) {
            for (u32 w = 1; w < blockDim.x / 32; ++w) {
                if (s_warp_stamp[w] < best_s || (s_warp_stamp[w] == best_s && s_warp_idx[w] < best_i)) {
                    best_s = s_warp_stamp[w];
                    best_i = s_warp_idx[w];
                }
            }
            s_victim[m] = best_i;
            if (best_i != TAIL_NONE) {
                s_stamp[best_i] = now;
                s_at[m] = s_fetched++;
            }
        }
        __syncthreads();
    }
    // 3. The promotions, one thread each (distinct victims, and no evicted
    //    key is a key of this launch: its slot would carry this launch's
    //    stamp).
    if (tid < nm) {
        const u32 v = s_victim[tid], k = s_miss[tid];
        if (v == TAIL_NONE) {
            // No slot: the GEMVs read it in place from its host bytes.
            if (!prefetch) atomicAdd(&counters[3], (u64)s_pairs[tid]);
        } else {
            const u32 old = owner[v];
            const u32 was_pending = pending[v];
            const u64 sl = slot[v], src = host[k];
            if (old != TAIL_NONE) {
                table[old] = home[old];
                tail_of[old] = TAIL_NONE;
            }
            if (was_pending) atomicAdd(&counters[7], 1ull);
            pending[v] = prefetch ? 1u : 0u;
            owner[v] = k;
            // A guess enters the LRU order at its old end (1).
            stamp[v] = prefetch ? 1u : now;
            tail_of[k] = v;
            // A demand promotion is marked fresh: the GEMVs launched right
            // after tail_fetch wait for it before they read this expert
            // (common.cuh). A prefetch's copy is joined by an event first.
            table[k] = mark ? (sl | TABLE_FRESH) : sl;
            const u32 f = s_at[tid];
            fetch[2 * f] = src;
            fetch[2 * f + 1] = sl;
        }
    }
    if (tid == 0) {
        n_fetch[0] = s_fetched;
        if (s_fetched) atomicAdd(&counters[prefetch ? 5 : 2], (u64)s_fetched);
    }
}

// Launched as a programmatic dependent of tail_lookup on sm_90: it waits
// for the lookup (its fetch list and table) before it reads anything, and
// only then lets its own dependent (the layer's w13 GEMV) launch, so that
// kernel starts with the lookup complete and waits for this copy only
// where it meets a fresh entry.
extern "C" __global__ void __launch_bounds__(256)
    tail_fetch(const u64* __restrict__ fetch, const u32* __restrict__ n_fetch, u64 vecs_per_expert) {
    pdl_wait();
    pdl_trigger();
    const u32 n = n_fetch[0];
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u32 m = 0; m < n; ++m) {
        const uint4* src = (const uint4*)fetch[2 * m];
        uint4* dst = (uint4*)fetch[2 * m + 1];
        for (u64 v = (u64)blockIdx.x * blockDim.x + threadIdx.x; v < vecs_per_expert; v += stride) dst[v] = src[v];
    }
}

// home and table are written by another stream's lookups too: volatile
// stores, no read-modify-write.
extern "C" __global__ void __launch_bounds__(256)
    tail_home(u64* __restrict__ table, u64* __restrict__ home, const u64* __restrict__ list, u32 n) {
    const u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const u64 key = list[2 * i], a = list[2 * i + 1];
    ((volatile u64*)home)[key] = a;
    ((volatile u64*)table)[key] = a;
}
