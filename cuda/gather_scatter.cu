// Gather/scatter between a paged KV cache and a contiguous staging buffer: one launch per batch.
//
// Semantics are those of the torch reference (client/copies.py), byte for byte:
//   * a batch is a list of units (one chunk each: its group, its block ids, its staging offset);
//   * a unit's staging bytes are [layer][block][page] over its group's layers, in order, each
//     layer with its own page size (a group may mix page sizes: MLA latents + indexer caches);
//   * block id -1 is skipped (its staging bytes and no KV byte are touched);
//   * block b of a layer is the layer's page_bytes bytes at layer_base + b * stride_bytes.
//
// Tables (all 64-bit ints, built by client/kernels.py):
//   layers[4 * L + 0..3] = global layer L's base address, block stride (bytes), page_bytes, and
//                          the offset of its pages in a unit (blocks_per_chunk * the page bytes of
//                          the group's layers before it)
//   groups[3 * g + 0..2] = first global layer, number of layers, blocks_per_chunk
//   units[3 * u + 0..2] = group, index of its first block id in block_ids, staging offset (bytes)
//   block_ids[...]      = every unit's blocks_per_chunk block ids, back to back
//
// Grid: x = page of the unit (layer * blocks_per_chunk + block), y = unit (strided when there are
// more than gridDim.y units). Each CUDA block copies whole pages; its threads share one page.
// A page is copied with 16-byte loads and stores when its source and destination addresses agree
// modulo 16 (a byte-wise head up to 16-alignment, 16-byte body, byte-wise tail); byte by byte
// otherwise. The page copy is __host__ __device__ so that a CPU harness can run the same code.
//
// Compiled by NVRTC through cupy.RawModule (no standard headers: builtin types only).

#define KVT_VEC 16
#define KVT_UNROLL 4

struct KvtPage {
    unsigned char* dst;
    const unsigned char* src;
    long long nbytes;
};

// The page of unit u at x (= layer * blocks_per_chunk + block), for gather (to_staging != 0) or
// scatter. Returns 0 when x is past the unit's pages or the block id is -1 (nothing to copy).
__host__ __device__ inline int kvt_page(
    const long long* layers, const long long* groups, const long long* units,
    const long long* block_ids, unsigned char* staging, long long u, long long x, int to_staging,
    KvtPage* page)
{
    const long long g = units[3 * u + 0];
    const long long first_block = units[3 * u + 1];
    const long long staging_offset = units[3 * u + 2];
    const long long first_layer = groups[3 * g + 0];
    const long long num_layers = groups[3 * g + 1];
    const long long blocks = groups[3 * g + 2];
    if (x >= num_layers * blocks) return 0;
    const long long layer = x / blocks;
    const long long j = x - layer * blocks;
    const long long b = block_ids[first_block + j];
    if (b < 0) return 0;
    const long long* row = layers + 4 * (first_layer + layer);
    const long long page_bytes = row[2];
    unsigned char* kv = (unsigned char*)row[0] + b * row[1];
    unsigned char* st = staging + staging_offset + row[3] + j * page_bytes;
    page->dst = to_staging ? st : kv;
    page->src = to_staging ? kv : st;
    page->nbytes = page_bytes;
    return 1;
}

// Whether a page takes the 16-byte path: source and destination agree modulo 16.
__host__ __device__ inline int kvt_vector_ok(const unsigned char* dst, const unsigned char* src)
{
    return ((((unsigned long long)dst) ^ ((unsigned long long)src)) & (KVT_VEC - 1)) == 0;
}

// Copy one page with `nthreads` cooperating threads; thread `tid` does its share. Threads touch
// disjoint bytes, so running them one after the other (the CPU harness) gives the same result.
__host__ __device__ inline void kvt_copy_page(const KvtPage& p, long long tid, long long nthreads)
{
    unsigned char* dst = p.dst;
    const unsigned char* src = p.src;
    long long n = p.nbytes;
    if (kvt_vector_ok(dst, src)) {
        long long head = (KVT_VEC - (long long)(((unsigned long long)dst) & (KVT_VEC - 1))) & (KVT_VEC - 1);
        if (head > n) head = n;
        for (long long i = tid; i < head; i += nthreads) dst[i] = src[i];
        dst += head;
        src += head;
        n -= head;
        const long long vecs = n / KVT_VEC;
        uint4* vdst = (uint4*)dst;
        const uint4* vsrc = (const uint4*)src;
        long long i = tid;
        // KVT_UNROLL loads in flight per thread before their stores: more bytes in flight per SM.
        for (; i + (KVT_UNROLL - 1) * nthreads < vecs; i += KVT_UNROLL * nthreads) {
            uint4 r[KVT_UNROLL];
#pragma unroll
            for (int k = 0; k < KVT_UNROLL; ++k) r[k] = vsrc[i + k * nthreads];
#pragma unroll
            for (int k = 0; k < KVT_UNROLL; ++k) vdst[i + k * nthreads] = r[k];
        }
        for (; i < vecs; i += nthreads) vdst[i] = vsrc[i];
        const long long done = vecs * KVT_VEC;
        for (long long t = done + tid; t < n; t += nthreads) dst[t] = src[t];
    } else {
        for (long long i = tid; i < n; i += nthreads) dst[i] = src[i];
    }
}

// One CUDA block's work: every page (u, x) with x == px and u == py (mod ny); host and device.
__host__ __device__ inline void kvt_block(
    const long long* layers, const long long* groups, const long long* units,
    const long long* block_ids, unsigned char* staging, long long num_units, int to_staging,
    long long px, long long py, long long ny, long long tid, long long nthreads)
{
    for (long long u = py; u < num_units; u += ny) {
        KvtPage page;
        if (kvt_page(layers, groups, units, block_ids, staging, u, px, to_staging, &page))
            kvt_copy_page(page, tid, nthreads);
    }
}

extern "C" __global__ void kvtier_gather(
    const long long* __restrict__ layers, const long long* __restrict__ groups,
    const long long* __restrict__ units, const long long* __restrict__ block_ids,
    unsigned char* staging, long long num_units)
{
    kvt_block(layers, groups, units, block_ids, staging, num_units, 1, blockIdx.x, blockIdx.y,
              gridDim.y, threadIdx.x, blockDim.x);
}

extern "C" __global__ void kvtier_scatter(
    const long long* __restrict__ layers, const long long* __restrict__ groups,
    const long long* __restrict__ units, const long long* __restrict__ block_ids,
    unsigned char* staging, long long num_units)
{
    kvt_block(layers, groups, units, block_ids, staging, num_units, 0, blockIdx.x, blockIdx.y,
              gridDim.y, threadIdx.x, blockDim.x);
}
