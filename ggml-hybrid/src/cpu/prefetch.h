/* Software prefetch of the decode tiles of every ISA folder: one home for the prefetch
 * modes, the distance and the hint (_mm_prefetch is SSE, so any x86 ISA file includes it). */
#ifndef GH_CPU_PREFETCH_H
#define GH_CPU_PREFETCH_H

#include <immintrin.h>
#include <stddef.h>

#ifndef GH_PF_TILES
#define GH_PF_TILES 3          /* decode prefetches the tile this many tiles ahead */
#endif
#ifndef GH_PF_HINT
#define GH_PF_HINT _MM_HINT_T1 /* into L2: into L1 the prefetched lines evict x */
#endif

/* Prefetch modes: none (prompt tiles, whose rows stay in L2), one linear stream starting
 * at pf[0] (decode), or the rows pf[0..4) (gathered rows). */
enum { PF_NONE, PF_LINEAR, PF_ROWS };

/* The prefetch of a four-row tile's last partial group (a row of 4g + 1..3 blocks, 576
 * columns, say): the rest of the linear stream (pl: where the full groups' prefetch
 * stopped; the tile's rows are contiguous), or each gathered row's last bytes (off: the
 * group's offset in the rows, tail: its bytes). Without it those lines were demand misses,
 * which halved decode GB/s on such rows (docs/BENCHMARKS.md, real models). */
static inline __attribute__((always_inline)) void gh_tail_prefetch(const int pfm, const char * pl,
                                                                    const void * const * pf,
                                                                    size_t off, size_t tail) {
    if (pfm == PF_LINEAR) {
        for (size_t k = 0; k < 4 * tail; k += 64) _mm_prefetch(pl + k, GH_PF_HINT);
    } else if (pfm == PF_ROWS) {
        for (int r = 0; r < 4; r++) {
            _mm_prefetch((const char *) pf[r] + off, GH_PF_HINT);
            _mm_prefetch((const char *) pf[r] + off + tail - 1, GH_PF_HINT);
        }
    }
}

#endif
