/* The context's statistics (stats.h). */
#include "core/stats.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

double gh_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double) ts.tv_sec + 1e-9 * (double) ts.tv_nsec;
}

gh_status gh_stats_init(gh_stats * s, int n_layer) {
    memset(s, 0, sizeof *s);
    s->n_layer = n_layer;
    s->layer_active = calloc((size_t) GH_MAX(n_layer, 1), sizeof(int64_t));
    return s->layer_active ? GH_OK : gh_fail(GH_ERR_OOM, "out of memory for the statistics");
}

void gh_stats_free(gh_stats * s) {
    free(s->layer_active);
    s->layer_active = NULL;
}

void gh_stats_reset(gh_stats * s) {
    int64_t * la = s->layer_active;
    const int nl = s->n_layer;
    memset(s, 0, sizeof *s);
    s->n_layer = nl;
    s->layer_active = la;
    if (la) memset(la, 0, (size_t) nl * sizeof(int64_t));
}

void gh_stats_add(gh_stats * s, gh_stage stage, double seconds, double bytes) {
    s->t[stage] += seconds;
    s->bytes[stage] += bytes;
}

void gh_stats_device(gh_stats * s, double device_s, double wait_s, double up_bytes,
                     double down_bytes, double weight_bytes) {
    s->t_device += device_s;
    s->t_wait += wait_s;
    s->bytes_up += up_bytes;
    s->bytes_down += down_bytes;
    s->bytes_device += weight_bytes;
}

void gh_stats_tokens(gh_stats * s, int32_t n, double seconds) {
    s->n_tokens += n;
    s->t_total += seconds;
}

void gh_stats_inputs(gh_stats * s, bool head, int64_t n_in, int64_t n_used) {
    if (head) {
        s->n_head_in += n_in;
        s->n_head_used += n_used;
    } else {
        s->n_attn_in += n_in;
        s->n_attn_used += n_used;
    }
}

void gh_stats_active(gh_stats * s, int il, int64_t n, int64_t n_dev) {
    s->n_active += n;
    s->n_active_device += n_dev;
    s->layer_active[il] += n;
    if (il == 0) s->n_sparse_tokens++;
}
