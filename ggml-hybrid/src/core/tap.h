/* The one observation hook of the forward pass (the idea of ggml's eval callback: a named
 * point, a layer, a buffer). The pass does its work and names what it did at a few points;
 * every observer hangs on the context's tap: the statistics always (core/stats.c), and one
 * further observer when a call sets it (the profiler of gh_eval_profile and gh_eval_embd,
 * model/profile.c). So the pass holds no profiling buffers, no strides and no clock
 * arithmetic of its own, and a new observer changes nothing in it.
 *
 * The tap also holds the stage clock: a stage's time is the time since the last mark, so
 * the pass only says where a stage ends (gh_tap_stage). */
#ifndef GH_TAP_H
#define GH_TAP_H

#include "core/stats.h"

typedef enum {
    /* buffers of n token rows (the rows of the current batch, in the batch's order) */
    GH_TAP_ATTN_IN,     /* buf: the attention's input (q/k/v's) [n][n_embd] */
    GH_TAP_ATTN_OUT_IN, /* buf: the heads' outputs (o's input) [n][n_head * head_dim] */
    GH_TAP_FFN_IN,      /* buf: the FFN's input [n][n_embd] */
    GH_TAP_FFN_GATE,    /* the dense FFN before its activation: buf the gate [n][n_ff] (bias
                         * added), buf2 up (NULL: an ungated FFN) */
    GH_TAP_FFN_ACT,     /* buf: the dense FFN's activation act(gate, up) [n][n_ff] */
    GH_TAP_HEAD_IN,     /* buf: the head's input (the output norm of x) [n][n_embd], every
                         * row of the batch */
    GH_TAP_N_BUFFERS,
    /* counts (core/stats.h reads them) */
    GH_TAP_STAGE = GH_TAP_N_BUFFERS, /* stage: `seconds` and `bytes` (weight bytes read) */
    GH_TAP_DEVICE,      /* a device call: `seconds` on the device's clock, `wait` the CPU's
                         * wait for it, `up` / `down` activation bytes sent and received,
                         * `bytes` weight bytes it read, `cpu` the CPU's own FFN rows' time
                         * beside it */
    GH_TAP_SELECT,      /* one token's FFN in layer il: `count` active neurons, `count2` of
                         * them on the device */
    GH_TAP_ROWS,        /* FFN rows computed: `count` up rows, `count2` down rows */
    GH_TAP_INPUTS,      /* an input-sparse projection of stage (ATTENTION, or OTHER: the
                         * head): `count` inputs seen, `count2` of them used */
    GH_TAP_TOKENS,      /* a forward call ended: n tokens in `seconds` */
} gh_tap_point;

typedef struct gh_tap_ev {
    gh_tap_point  point;
    int           il;       /* the layer (-1: none) */
    int32_t       n;        /* token rows */
    const float * buf;
    const float * buf2;
    gh_stage      stage;
    double        seconds, wait, bytes, up, down, cpu;
    int64_t       count, count2;
} gh_tap_ev;

/* An observer: it reads the event and its buffers during the call only. */
typedef void (*gh_tap_fn)(void * user, const gh_tap_ev * ev);

typedef struct {
    gh_stats * stats;   /* always observes (the context's) */
    gh_tap_fn  fn;      /* the call's further observer; NULL: none */
    void *     user;
    unsigned   wants;   /* the buffer points fn takes, a bit each (1u << point) */
    double     t_start; /* the clock at the forward call's start */
    double     t_mark;  /* the clock at the last stage mark */
} gh_tap;

/* Sets (fn NULL: clears) the further observer and the buffer points it takes. */
void gh_tap_set(gh_tap * t, gh_tap_fn fn, void * user, unsigned wants);

/* Whether an observer takes buffer point p (so the pass makes what it needs only then). */
static inline bool gh_tap_wants(const gh_tap * t, gh_tap_point p) {
    return t->fn && (t->wants >> p & 1u);
}

/* Hands ev to every observer. */
void gh_tap_emit(gh_tap * t, const gh_tap_ev * ev);

/* Buffer point p of layer il (n rows of buf, buf2), when an observer takes it. */
void gh_tap_buf(gh_tap * t, gh_tap_point p, int il, int32_t n, const float * buf,
                const float * buf2);

/* The stage clock: gh_tap_begin at a forward call's start, gh_tap_mark to leave the time
 * since the last mark out of every stage, gh_tap_stage where a stage ends (its time is the
 * time since the last mark; bytes: the weight bytes it read), gh_tap_end at the call's end
 * (n tokens, the call's time). */
void gh_tap_begin(gh_tap * t);
void gh_tap_mark(gh_tap * t);
void gh_tap_stage(gh_tap * t, gh_stage s, double bytes);
void gh_tap_end(gh_tap * t, int32_t n);

/* Weight bytes a stage read, its time counted where it ends. */
void gh_tap_bytes(gh_tap * t, gh_stage s, double bytes);
/* Counts without buffers (GH_TAP_SELECT, _ROWS, _INPUTS): count and count2 of point p. */
void gh_tap_count(gh_tap * t, gh_tap_point p, int il, gh_stage s, int64_t count, int64_t count2);

#endif
