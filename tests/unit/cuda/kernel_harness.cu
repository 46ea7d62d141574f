// Runs the kernels' own page logic (cuda/gather_scatter.cu, included as is) on the CPU: every
// CUDA block (x, y) of the launch grid and every thread of it, one after the other. Threads of a
// page copy disjoint bytes, so the result is the one a GPU launch of the same grid gives.
#include "gather_scatter.cu"

extern "C" void kvt_emulate(const long long* layers, const long long* groups,
                            const long long* units, const long long* block_ids,
                            unsigned char* staging, long long num_units, int to_staging,
                            long long grid_x, long long grid_y, long long threads)
{
    for (long long py = 0; py < grid_y; ++py)
        for (long long px = 0; px < grid_x; ++px)
            for (long long tid = 0; tid < threads; ++tid)
                kvt_block(layers, groups, units, block_ids, staging, num_units, to_staging, px,
                          py, grid_y, tid, threads);
}
