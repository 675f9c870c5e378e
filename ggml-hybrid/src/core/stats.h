/* The statistics a context keeps (one gh_stats, owned by the context) and the clock the
 * forward pass times its stages with. Plain counters: whoever does the work adds to them,
 * gh_context_get_stats (model/context.c) reads them out. Nothing here knows of models or
 * contexts, so every module may record into it without an include running back up. */
#ifndef GH_STATS_H
#define GH_STATS_H

#include "core/common.h"

typedef enum { GH_STAGE_ATTENTION, GH_STAGE_PREDICTOR, GH_STAGE_FFN, GH_STAGE_OTHER,
               GH_STAGE_COUNT } gh_stage;

double gh_now(void);  /* monotonic seconds */

typedef struct gh_stats {
    double    t[GH_STAGE_COUNT];
    double    bytes[GH_STAGE_COUNT];  /* weight bytes read; OTHER = the output head */
    double    t_total;
    int64_t   n_tokens, n_sparse_tokens, n_active, n_up_rows, n_down_rows;
    int       n_layer;
    int64_t * layer_active;  /* [n_layer] active neurons summed over sparse tokens */
    int64_t   n_active_device;
    int64_t   n_attn_in, n_attn_used, n_head_in, n_head_used; /* input-sparse projections */
    double    bytes_device, bytes_up, bytes_down, t_device, t_cpu_ffn, t_wait;
} gh_stats;

/* Zeroed counters for n_layer layers; GH_ERR_OOM (message set) on failure. */
gh_status gh_stats_init(gh_stats * s, int n_layer);
void gh_stats_free(gh_stats * s);
void gh_stats_reset(gh_stats * s);

/* A stage's time in seconds and the weight bytes it read. */
void gh_stats_add(gh_stats * s, gh_stage stage, double seconds, double bytes);
/* A device call: its time on the device's clock, the CPU's wait for it, activation bytes
 * sent and received, and weight bytes the device read. */
void gh_stats_device(gh_stats * s, double device_s, double wait_s, double up_bytes,
                     double down_bytes, double weight_bytes);
/* After each forward call: n tokens and the call's seconds. */
void gh_stats_tokens(gh_stats * s, int32_t n, double seconds);
/* Input-sparse projections: n_in input channels seen, n_used of them used, by the attention
 * (head false) or the head. */
void gh_stats_inputs(gh_stats * s, bool head, int64_t n_in, int64_t n_used);
/* One sparse token's FFN in layer il: n active neurons, n_dev of them on the device. */
void gh_stats_active(gh_stats * s, int il, int64_t n, int64_t n_dev);

#endif
