/* The statistics a context keeps (one gh_stats, owned by the context) and the clock. Plain
 * counters, added to by one observer of the context's tap (core/tap.h: the forward pass
 * names what it did, gh_stats_observe counts it); gh_context_get_stats (model/context.c)
 * reads them out. Nothing here knows of models or contexts. */
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
    int       il_tokens;     /* the layer whose selections count n_sparse_tokens: the first
                              * with a sparse FFN (a mixture's first with experts) */
    int64_t * layer_active;  /* [n_layer] active neurons summed over sparse tokens */
    int64_t   n_active_device;
    int64_t   n_attn_in, n_attn_used, n_head_in, n_head_used; /* input-sparse projections */
    double    bytes_device, bytes_up, bytes_down, t_device, t_cpu_ffn, t_wait;
} gh_stats;

/* Zeroed counters for n_layer layers, the tokens counted at layer il_tokens' selections;
 * GH_ERR_OOM (message set) on failure. */
gh_status gh_stats_init(gh_stats * s, int n_layer, int il_tokens);
void gh_stats_free(gh_stats * s);
void gh_stats_reset(gh_stats * s);

/* Adds what an event of the tap (core/tap.h) counts: a stage's time and bytes, a device
 * call, a token's selection, rows computed, a projection's inputs, a forward call's tokens.
 * The context's tap hands every count event here; this is the one place that knows which
 * counter an event adds to. */
struct gh_tap_ev;
void gh_stats_observe(gh_stats * s, const struct gh_tap_ev * ev);

#endif
