/* The model placed on a device (placement.c): its weights put on a device backend under a
 * VRAM budget, with the FFN neurons of each layer split by the GPU index (neuron-split
 * tensors), its device state (gh_hybrid, m->hy), and the per-context device stream.
 *
 * It lives in model/, not backend/, because it reads the model's structs: the backends
 * know only their interface (backend/backend.h), and the model uses them through it, so
 * the dependency runs one way, model/ -> backend/. */
#ifndef GH_MODEL_PLACEMENT_H
#define GH_MODEL_PLACEMENT_H

#include "backend/backend.h"
#include "cpu/ops.h"
#include "ffn/experts.h"

/* One expert of a mixture-of-experts layer on the device: its gate, up and down matrices
 * as the file holds them (gate/up: n_ff_exp x n_embd, down: n_embd x n_ff_exp), run by
 * the backend's matmul (ffn/moe.c). gate.data == NULL: the expert is on the CPU. */
typedef struct {
    gh_dweight gate, up, down;
} gh_dexpert;

/* A neuron split of one FFN unit (a dense layer's FFN, or one expert of a mixture viewed
 * as a layer): the device holds the hot neurons' rows of gate, up and down_t compacted
 * (row k = neuron bucket[k]); the CPU keeps the full matrices (mapped or read, see
 * gh_load_mode) and skips the rows whose row_of is >= 0. The FFN executor (ffn/exec.c)
 * runs any unit through one of these. hot.n_hot == 0: the unit is CPU only. */
typedef struct gh_dsplit {
    gh_dffn    hot;
    int32_t *  bucket;           /* [n_hot] neuron ids, ascending (host) */
    int32_t *  row_of;           /* [n_ff] compacted row of a neuron, -1 if cold (host) */
    int32_t *  cold;             /* [n_cold] the other neurons, ascending (host): where a
                                  * strategy needs the dense gate, the CPU computes theirs */
    int64_t    n_cold;
} gh_dsplit;

/* One layer's device-resident parts. */
typedef struct {
    bool       att;              /* wq, wk, wv, wo on the device */
    gh_dweight wq, wk, wv, wo;
    bool       pred;             /* fc1, fc2 on the device */
    gh_dweight fc1, fc2;
    gh_dsplit  ffn;              /* the layer's hot neurons (dense FFN layers) */
    /* mixture of experts: the router (router.data NULL: on the CPU) and the placed experts
     * ([n_expert]; NULL when the layer has none on the device) */
    gh_dweight router;
    gh_dexpert * exps;
    /* sparse experts (ffn_down_exps_t): each expert's hot neurons ([n_expert]; NULL when
     * the layer has none on the device; an expert's hot.n_hot 0: all on the CPU), run by
     * the FFN executor per selected expert as a dense layer's are */
    gh_dsplit *  exp_hot;
    /* the shared expert (qwen2moe; shexp.gate.data NULL: on the CPU); its sigmoid gate
     * (one vector) stays on the host */
    gh_dexpert shexp;
} gh_dlayer;

typedef struct gh_hybrid {
    gh_backend *   b;
    gh_dlayer *    layers;       /* [n_layer] */
    int            n_layer;
    int32_t        n_expert;     /* the model's (exp_hot's length) */
    bool           head;
    gh_dweight     output;
    gh_device_info info;
    /* the expert cache each context makes (ffn/moe.c): slots of slot_bytes, one expert
     * each (0 slots: none) */
    int32_t        cache_slots;
    size_t         slot_bytes;
    void **        bufs;         /* every device allocation, freed with the model */
    int            n_bufs, cap_bufs;
} gh_hybrid;

struct gh_model;
struct gh_context;

/* Places the model on p->device (the model is loaded; m->hy stays NULL for cpu). */
gh_status gh_hybrid_place(struct gh_model * m, const gh_model_params * p);
void gh_hybrid_free(gh_hybrid * hy);

/* Uploads expert e of M to the device memory at base (expert_bytes of it: gate | up |
 * down) and describes it in *out (the expert cache's refills, ffn/moe.c). */
gh_status gh_expert_upload(gh_backend * b, const gh_moe_layer * M, int32_t e, void * base,
                           gh_dexpert * out);

/* Tokens per device matmul call: a context's staging buffers hold this many rows of
 * activations, and bigger batches are sent in chunks. */
#define GH_DEVICE_CHUNK 32

/* The context's stream (NULL message-set on failure); sized for the model. */
gh_status gh_hybrid_stream_new(const struct gh_model * m, gh_stream ** out);

/* Enqueues y = W x for n tokens ([n][w->rows]) of a device weight (chunks of
 * GH_DEVICE_CHUNK tokens); y is ready after gh_hybrid_sync. Counts the stats. Returns the
 * first chunk's error (the later chunks are not enqueued); the caller still syncs, since
 * the chunks before it may be running. */
gh_status gh_hybrid_matmul_async(struct gh_context * c, const gh_dweight * w, const float * x,
                                 int64_t n, float * y);
/* Waits for the context's device work (its time into the stats), also after a failed
 * enqueue, so that nothing still writes a host buffer once the caller returns. Returns st
 * (the caller's error so far) if set, else the sync's: device errors reach gh_eval up the
 * call chain. */
gh_status gh_hybrid_sync(struct gh_context * c, gh_status st);

#endif
