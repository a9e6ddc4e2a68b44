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
//                 (resident, prior or tail) or the expert's mapped host bytes
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
// pairs, P <= 256), in one of two modes.
// Demand (after the layer's router; its GEMVs run next):
//   1. clock += 1. A pair hits when table[key] != host[key]; a tail hit
//      stamps its slot with the clock (and a pending slot counts as a useful
//      prefetch). A hit whose table entry is not its tail slot (its prior
//      slot landed meanwhile, tail_home) frees that tail slot instead.
//   2. The layer's distinct missing experts, rank-major (every row's first
//      choice, then every row's second, ...), each take the least recently
//      stamped tail slot (ties: lowest index) whose stamp is not this
//      launch's clock, so never a slot an expert of this launch uses. The
//      slot's previous owner points back at its home, the new key at the
//      slot, and (host, slot) joins the fetch list.
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

extern "C" __global__ void __launch_bounds__(256)
    tail_lookup(u64* __restrict__ table, const u64* __restrict__ host,
                const u64* home,  // no __restrict__: tail_home writes it from another stream
                u32* __restrict__ tail_of,
                u32* __restrict__ owner, u32* __restrict__ stamp, u32* __restrict__ pending,
                const u64* __restrict__ slot, u32* __restrict__ clock, u64* __restrict__ fetch,
                u32* __restrict__ n_fetch, u64* __restrict__ counters, const u32* __restrict__ ids,
                u32 n_pairs, u32 layer, u32 experts, u32 tail, u32 top_k, u32 prefetch,
                u32 max_promote) {
    __shared__ u32 s_key[TAIL_MAX_PAIRS];
    __shared__ unsigned char s_hit[TAIL_MAX_PAIRS];
    __shared__ u32 s_miss[TAIL_MAX_PAIRS];
    __shared__ u32 s_pairs[TAIL_MAX_PAIRS];
    __shared__ u32 s_promoted[TAIL_MAX_PAIRS];  // prefetch: the slots it filled
    __shared__ u32 s_warp_stamp[8], s_warp_idx[8];
    __shared__ u32 s_now, s_n_miss, s_useful;
    const u32 tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid == 0) {
        s_now = clock[0] + 1;
        clock[0] = s_now;
        s_useful = 0;
    }
    __syncthreads();
    const u32 now = s_now;
    // A prefetch also spares the previous launch's slots (0: never used).
    const u32 spared = prefetch && now > 1 ? now - 1 : now;
    if (tid < n_pairs) {
        const u32 e = ids[tid];
        if (e >= experts) asm volatile("trap;");
        const u32 key = layer * experts + e;
        const u64 at = table[key];
        const bool hit = at != host[key];
        s_key[tid] = key;
        s_hit[tid] = hit;
        if (hit) {
            const u32 t = tail_of[key];
            if (t != TAIL_NONE && at != slot[t]) {
                // Its prior slot landed while the tail held it (tail_home):
                // nothing reads this slot any more, so it is free at once
                // (kept, a hot expert's hits would keep it most recent and
                // out of use for the whole decode).
                owner[t] = TAIL_NONE;
                tail_of[key] = TAIL_NONE;
                stamp[t] = 0;
                if (atomicExch(&pending[t], 0u) != 0u) atomicAdd((unsigned long long*)&counters[7], 1ull);
            } else if (t != TAIL_NONE) {
                stamp[t] = now;
                // Several rows may hit one slot: count it once.
                if (!prefetch && atomicExch(&pending[t], 0u) != 0u) atomicAdd(&s_useful, 1u);
            }
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
        if (prefetch) {
            counters[4] += n_pairs;
        } else {
            counters[0] += n_pairs;
            counters[1] += hits;
            counters[6] += s_useful;
        }
    }
    __syncthreads();
    u32 fetched = 0, in_place = 0, wasted = 0;  // thread 0's tallies
    for (u32 m = 0; m < s_n_miss; ++m) {
        // Least recently used slot not used by this launch (nor, for a
        // prefetch, by the previous one): (stamp, index).
        u32 best_s = TAIL_NONE, best_i = TAIL_NONE;
        for (u32 t = tid; t < tail; t += blockDim.x) {
            const u32 s = stamp[t];
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
            const u32 key = s_miss[m];
            if (best_i == TAIL_NONE) {
                if (!prefetch) in_place += s_pairs[m];
            } else {
                const u32 old = owner[best_i];
                if (old != TAIL_NONE) {
                    table[old] = home[old];
                    tail_of[old] = TAIL_NONE;
                }
                wasted += pending[best_i];
                pending[best_i] = prefetch ? 1u : 0u;
                owner[best_i] = key;
                stamp[best_i] = now;
                tail_of[key] = best_i;
                table[key] = slot[best_i];
                fetch[2 * fetched] = host[key];
                fetch[2 * fetched + 1] = slot[best_i];
                s_promoted[fetched] = best_i;
                ++fetched;
            }
        }
        __syncthreads();
    }
    if (tid == 0) {
        // Stamped `now` until here so the launch never evicts its own.
        if (prefetch)
            for (u32 m = 0; m < fetched; ++m) stamp[s_promoted[m]] = 1;
        n_fetch[0] = fetched;
        counters[prefetch ? 5 : 2] += fetched;
        counters[3] += in_place;
        counters[7] += wasted;
    }
}

extern "C" __global__ void __launch_bounds__(256)
    tail_fetch(const u64* __restrict__ fetch, const u32* __restrict__ n_fetch, u64 vecs_per_expert) {
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
