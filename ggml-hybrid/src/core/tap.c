/* The observation hook (tap.h). */
#include "core/tap.h"

void gh_tap_set(gh_tap * t, gh_tap_fn fn, void * user, unsigned wants) {
    t->fn = fn;
    t->user = fn ? user : NULL;
    t->wants = fn ? wants : 0u;
}

void gh_tap_emit(gh_tap * t, const gh_tap_ev * ev) {
    if (ev->point >= GH_TAP_N_BUFFERS) gh_stats_observe(t->stats, ev);
    if (t->fn) t->fn(t->user, ev);
}

void gh_tap_buf(gh_tap * t, gh_tap_point p, int il, int32_t n, const float * buf,
                const float * buf2) {
    if (!gh_tap_wants(t, p)) return;
    const gh_tap_ev ev = { .point = p, .il = il, .n = n, .buf = buf, .buf2 = buf2 };
    t->fn(t->user, &ev);
}

void gh_tap_begin(gh_tap * t) {
    t->t_start = t->t_mark = gh_now();
}

void gh_tap_mark(gh_tap * t) {
    t->t_mark = gh_now();
}

void gh_tap_stage(gh_tap * t, gh_stage s, double bytes) {
    const double now = gh_now();
    const gh_tap_ev ev = { .point = GH_TAP_STAGE, .il = -1, .stage = s,
                           .seconds = now - t->t_mark, .bytes = bytes };
    t->t_mark = now;
    gh_tap_emit(t, &ev);
}

void gh_tap_end(gh_tap * t, int32_t n) {
    const gh_tap_ev ev = { .point = GH_TAP_TOKENS, .il = -1, .n = n,
                           .seconds = gh_now() - t->t_start };
    gh_tap_emit(t, &ev);
}

void gh_tap_bytes(gh_tap * t, gh_stage s, double bytes) {
    const gh_tap_ev ev = { .point = GH_TAP_STAGE, .il = -1, .stage = s, .bytes = bytes };
    gh_tap_emit(t, &ev);
}

void gh_tap_count(gh_tap * t, gh_tap_point p, int il, gh_stage s, int64_t count, int64_t count2) {
    const gh_tap_ev ev = { .point = p, .il = il, .stage = s, .count = count, .count2 = count2 };
    gh_tap_emit(t, &ev);
}
