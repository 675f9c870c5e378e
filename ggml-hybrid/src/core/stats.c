/* The context's statistics (stats.h). */
#include "core/stats.h"
#include "core/tap.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

double gh_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

gh_status gh_stats_init(gh_stats * s, int n_layer, int il_tokens) {
    memset(s, 0, sizeof *s);
    s->n_layer = n_layer;
    s->il_tokens = il_tokens;
    s->layer_active = calloc((size_t) GH_MAX(n_layer, 1), sizeof(int64_t));
    return s->layer_active ? GH_OK : gh_fail(GH_ERR_OOM, "out of memory for the statistics");
}

void gh_stats_free(gh_stats * s) {
    free(s->layer_active);
    s->layer_active = NULL;
}

void gh_stats_reset(gh_stats * s) {
    int64_t * la = s->layer_active;
    const int nl = s->n_layer, it = s->il_tokens;
    memset(s, 0, sizeof *s);
    s->n_layer = nl;
    s->il_tokens = it;
    s->layer_active = la;
    if (la) memset(la, 0, (size_t) nl * sizeof(int64_t));
}

void gh_stats_observe(gh_stats * s, const gh_tap_ev * ev) {
    switch (ev->point) {
    case GH_TAP_STAGE:
        s->t[ev->stage] += ev->seconds;
        s->bytes[ev->stage] += ev->bytes;
        break;
    case GH_TAP_DEVICE:
        s->t_cpu_ffn += ev->cpu;
        s->t_device += ev->seconds;
        s->t_wait += ev->wait;
        s->bytes_up += ev->up;
        s->bytes_down += ev->down;
        s->bytes_device += ev->bytes;
        break;
    case GH_TAP_SELECT:
        s->n_active += ev->count;
        s->n_active_device += ev->count2;
        s->layer_active[ev->il] += ev->count;
        if (ev->il == s->il_tokens) s->n_sparse_tokens++;
        break;
    case GH_TAP_ROWS:
        s->n_up_rows += ev->count;
        s->n_down_rows += ev->count2;
        break;
    case GH_TAP_INPUTS:
        if (ev->stage == GH_STAGE_OTHER) { /* the head */
            s->n_head_in += ev->count;
            s->n_head_used += ev->count2;
        } else {
            s->n_attn_in += ev->count;
            s->n_attn_used += ev->count2;
        }
        break;
    case GH_TAP_TOKENS:
        s->n_tokens += ev->n;
        s->t_total += ev->seconds;
        break;
    default: /* buffers: the profiler's */
        break;
    }
}
