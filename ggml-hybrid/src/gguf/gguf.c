/* GGUF reader (versions 2 and 3; both use 64-bit counts and lengths).
 *
 * File layout (all little-endian):
 *   "GGUF" (or PowerInfer's "PWRI") u32 version, u64 n_tensors, u64 n_kv
 *   n_kv      x { string key, u32 value_type, value }
 *   n_tensors x { string name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset }
 *   padding to general.alignment (default 32), then the data section; tensor offsets
 *   are relative to the start of the data section.
 *   string = u64 length + bytes (no NUL); array = u32 elem_type, u64 count, elements.
 *
 * The image is untrusted. Every read goes through the cursor below, which checks the
 * remaining length first; every size computed from file values is overflow-checked;
 * counts are checked against the bytes left before any array is allocated for them.
 * Errors free everything through gh_gguf_close (which accepts a half-built handle). */
#include "gguf/gguf.h"
#include "types/types.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_KEY_LEN  (64u * 1024)          /* keys and tensor names */
#define GGUF_MAX_STR_LEN  (1024u * 1024)        /* string values (copied) */
#define GGUF_MAX_NE       ((uint64_t) 1 << 62)  /* per dimension */

/* Smallest possible encodings, used to bound counts before allocating:
 * kv: key length (8) + 1 key byte + value type (4) + smallest value (1);
 * tensor: name length (8) + 1 name byte + n_dims (4) + one ne (8) + type (4) + offset (8). */
#define GGUF_MIN_KV_BYTES     14u
#define GGUF_MIN_TENSOR_BYTES 33u

static const char * const k_vtype_names[] = {
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool",
    "string", "array", "uint64", "int64", "float64",
};

/* Encoded size of a fixed-size value type; 0 for string/array/unknown. */
static uint64_t vtype_size(uint32_t t) {
    switch (t) {
    case GH_GGUF_UINT8: case GH_GGUF_INT8: case GH_GGUF_BOOL: return 1;
    case GH_GGUF_UINT16: case GH_GGUF_INT16: return 2;
    case GH_GGUF_UINT32: case GH_GGUF_INT32: case GH_GGUF_FLOAT32: return 4;
    case GH_GGUF_UINT64: case GH_GGUF_INT64: case GH_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

const char * gh_gguf_vtype_name(int type) {
    if (type < 0 || type >= (int) (sizeof k_vtype_names / sizeof k_vtype_names[0])) return "unknown";
    return k_vtype_names[type];
}

/* ---- parser state and bounds-checked reads ---- */

typedef struct {
    const uint8_t * base;
    size_t          size;
    size_t          pos;    /* invariant: pos <= size */
    const char *    label;  /* path, or "<memory>", for messages */
} cursor;

static gh_status perr(const cursor * c, gh_status st, const char * fmt, ...)
    __attribute__((format(printf, 3, 4)));

static gh_status perr(const cursor * c, gh_status st, const char * fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return gh_fail(st, "GGUF '%.200s': %s", c->label, msg);
}

static bool has(const cursor * c, uint64_t n) { return n <= (uint64_t) (c->size - c->pos); }

static uint64_t load_le(const uint8_t * p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* Read an n-byte little-endian integer; `what` names the field for the message. */
static gh_status rd_uint(cursor * c, int n, uint64_t * out, const char * what) {
    *out = 0;
    if (!has(c, (uint64_t) n))
        return perr(c, GH_ERR_FORMAT, "truncated: file ends in %s at offset %zu (%zu bytes)",
                    what, c->pos, c->size);
    *out = load_le(c->base + c->pos, n);
    c->pos += (size_t) n;
    return GH_OK;
}

static gh_status rd_u32(cursor * c, uint32_t * out, const char * what) {
    uint64_t v = 0;
    gh_status st = rd_uint(c, 4, &v, what);
    *out = (uint32_t) v;
    return st;
}

/* A string: u64 length then bytes. Returns a pointer into the image. */
static gh_status rd_str(cursor * c, const uint8_t ** s, uint64_t * len, uint64_t max_len,
                        const char * what) {
    size_t at = c->pos;
    gh_status st = rd_uint(c, 8, len, what);
    if (st != GH_OK) return st;
    if (!has(c, *len))
        return perr(c, GH_ERR_FORMAT,
                    "%s at offset %zu claims %llu bytes but only %zu remain in the file",
                    what, at, (unsigned long long) *len, c->size - c->pos);
    if (*len > max_len)
        return perr(c, GH_ERR_FORMAT, "%s at offset %zu is too long (%llu bytes, max %llu)",
                    what, at, (unsigned long long) *len, (unsigned long long) max_len);
    *s = c->base + c->pos;
    c->pos += (size_t) *len;
    return GH_OK;
}

/* A NUL-terminated heap copy of a string that must not contain NUL bytes. */
static gh_status dup_str(const cursor * c, const uint8_t * s, uint64_t len, char ** out,
                         const char * what) {
    if (memchr(s, 0, (size_t) len) != NULL)
        return perr(c, GH_ERR_FORMAT, "%s contains a NUL byte", what);
    char * p = malloc((size_t) len + 1);
    if (!p) return perr(c, GH_ERR_OOM, "out of memory copying %s (%llu bytes)", what,
                        (unsigned long long) len);
    memcpy(p, s, (size_t) len);
    p[len] = '\0';
    *out = p;
    return GH_OK;
}

/* Strict UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF. */
static bool utf8_valid(const uint8_t * s, uint64_t n) {
    uint64_t i = 0;
    while (i < n) {
        uint8_t b = s[i];
        if (b < 0x80) { i++; continue; }
        int len;
        uint32_t cp, min;
        if ((b & 0xE0) == 0xC0) { len = 2; cp = b & 0x1F; min = 0x80; }
        else if ((b & 0xF0) == 0xE0) { len = 3; cp = b & 0x0F; min = 0x800; }
        else if ((b & 0xF8) == 0xF0) { len = 4; cp = b & 0x07; min = 0x10000; }
        else return false;
        if ((uint64_t) len > n - i) return false;
        for (int k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
        i += (uint64_t) len;
    }
    return true;
}

/* A key or tensor name: non-empty, UTF-8, copied. */
static gh_status dup_name(const cursor * c, const uint8_t * s, uint64_t len, char ** out,
                          const char * what, uint64_t index, size_t at) {
    if (len == 0)
        return perr(c, GH_ERR_FORMAT, "%s %llu at offset %zu is empty", what,
                    (unsigned long long) index, at);
    if (!utf8_valid(s, len))
        return perr(c, GH_ERR_FORMAT, "%s %llu at offset %zu is not valid UTF-8", what,
                    (unsigned long long) index, at);
    return dup_str(c, s, len, out, what);
}

/* ---- name -> index hash tables (for duplicate detection and lookups) ---- */

static uint64_t hash_str(const char * s) {
    uint64_t h = 1469598103934665603ull;  /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t) *s) * 1099511628211ull;
    return h;
}

/* Capacity: the smallest power of two >= 2n (at least 8). n is already bounded by the
 * image size, so this cannot overflow. */
static uint64_t hash_cap(uint64_t n) {
    uint64_t cap = 8;
    while (cap < 2 * n) cap *= 2;
    return cap;
}

/* Find `name` in the table; returns the slot holding it or the empty slot where it
 * would go. names(i) is the name of entry i. */
static uint64_t hash_slot(const uint64_t * table, uint64_t cap, const char * name,
                          const char * (*names)(const void *, uint64_t), const void * ctx) {
    uint64_t i = hash_str(name) & (cap - 1);
    while (table[i] != 0 && strcmp(names(ctx, table[i] - 1), name) != 0) i = (i + 1) & (cap - 1);
    return i;
}

static const char * kv_name_at(const void * g, uint64_t i) { return ((const gh_gguf *) g)->kv[i].key; }
static const char * tensor_name_at(const void * g, uint64_t i) {
    return ((const gh_gguf *) g)->tensors[i].name;
}

/* ---- key/value section ---- */

static gh_status parse_value(cursor * c, gh_gguf_kv * kv) {
    const char * key = kv->key;
    uint64_t v;
    gh_status st;
    uint64_t sz = vtype_size((uint32_t) kv->type);
    if (sz != 0) {
        if ((st = rd_uint(c, (int) sz, &v, "a value")) != GH_OK) return st;
        switch (kv->type) {
        case GH_GGUF_UINT8: case GH_GGUF_UINT16: case GH_GGUF_UINT32: case GH_GGUF_UINT64:
            kv->v.u64 = v; break;
        case GH_GGUF_INT8:  kv->v.i64 = (int8_t) v; break;
        case GH_GGUF_INT16: kv->v.i64 = (int16_t) v; break;
        case GH_GGUF_INT32: kv->v.i64 = (int32_t) v; break;
        case GH_GGUF_INT64: kv->v.i64 = (int64_t) v; break;
        case GH_GGUF_FLOAT32: { uint32_t u = (uint32_t) v; float f; memcpy(&f, &u, 4); kv->v.f64 = f; break; }
        case GH_GGUF_FLOAT64: { double d; memcpy(&d, &v, 8); kv->v.f64 = d; break; }
        case GH_GGUF_BOOL:
            if (v > 1) return perr(c, GH_ERR_FORMAT, "key '%.200s': bool value %llu is not 0 or 1",
                                   key, (unsigned long long) v);
            kv->v.u64 = v;
            break;
        }
        return GH_OK;
    }
    if (kv->type == GH_GGUF_STRING) {
        const uint8_t * s;
        if ((st = rd_str(c, &s, &kv->str_len, GGUF_MAX_STR_LEN, "a string value")) != GH_OK) return st;
        return dup_str(c, s, kv->str_len, &kv->str, "a string value");
    }
    if (kv->type != GH_GGUF_ARRAY)
        return perr(c, GH_ERR_FORMAT, "key '%.200s': unknown value type %d at offset %zu",
                    key, kv->type, c->pos - 4);

    uint32_t et;
    if ((st = rd_u32(c, &et, "an array element type")) != GH_OK) return st;
    kv->arr_type = (int) et;
    if ((st = rd_uint(c, 8, &kv->arr_n, "an array length")) != GH_OK) return st;
    kv->arr_data = c->base + c->pos;
    if (et == GH_GGUF_ARRAY)
        return perr(c, GH_ERR_UNSUPPORTED, "key '%.200s': nested arrays are not supported", key);
    uint64_t esz = vtype_size(et);
    if (esz != 0) {
        uint64_t total;
        if (!gh_mul_ok(kv->arr_n, esz, &total) || !has(c, total))
            return perr(c, GH_ERR_FORMAT,
                        "key '%.200s': array of %llu %s elements does not fit in the %zu bytes left",
                        key, (unsigned long long) kv->arr_n, gh_gguf_vtype_name((int) et),
                        c->size - c->pos);
        if (et == GH_GGUF_BOOL) {
            for (uint64_t i = 0; i < kv->arr_n; i++)
                if (c->base[c->pos + i] > 1)
                    return perr(c, GH_ERR_FORMAT, "key '%.200s': bool element %llu is not 0 or 1",
                                key, (unsigned long long) i);
        }
        c->pos += (size_t) total;
        kv->arr_bytes = total;
        return GH_OK;
    }
    if (et == GH_GGUF_STRING) {
        /* Each element needs at least its 8-byte length: bound the count first, so a
         * huge count fails at once instead of after a long walk. */
        uint64_t min_total;
        if (!gh_mul_ok(kv->arr_n, 8, &min_total) || !has(c, min_total))
            return perr(c, GH_ERR_FORMAT,
                        "key '%.200s': array of %llu strings does not fit in the %zu bytes left",
                        key, (unsigned long long) kv->arr_n, c->size - c->pos);
        for (uint64_t i = 0; i < kv->arr_n; i++) {
            const uint8_t * s;
            uint64_t len;
            if ((st = rd_str(c, &s, &len, UINT64_MAX, "an array string")) != GH_OK) return st;
        }
        kv->arr_bytes = (uint64_t) (c->base + c->pos - kv->arr_data);
        return GH_OK;
    }
    return perr(c, GH_ERR_FORMAT, "key '%.200s': unknown array element type %u", key, et);
}

static gh_status parse_kvs(cursor * c, gh_gguf * g) {
    gh_status st;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        gh_gguf_kv * kv = &g->kv[i];
        const uint8_t * s;
        uint64_t len;
        size_t at = c->pos;
        if ((st = rd_str(c, &s, &len, GGUF_MAX_KEY_LEN, "a key")) != GH_OK) return st;
        if ((st = dup_name(c, s, len, &kv->key, "key", i, at)) != GH_OK) return st;
        uint64_t slot = hash_slot(g->kv_hash, g->kv_hash_cap, kv->key, kv_name_at, g);
        if (g->kv_hash[slot] != 0)
            return perr(c, GH_ERR_FORMAT, "duplicate key '%.200s'", kv->key);
        g->kv_hash[slot] = i + 1;
        uint32_t t;
        if ((st = rd_u32(c, &t, "a value type")) != GH_OK) return st;
        if (t > GH_GGUF_FLOAT64)
            return perr(c, GH_ERR_FORMAT, "key '%.200s': unknown value type %u at offset %zu",
                        kv->key, t, c->pos - 4);
        kv->type = (int) t;
        if ((st = parse_value(c, kv)) != GH_OK) return st;
    }
    return GH_OK;
}

/* ---- tensor infos ---- */

static gh_status parse_tensors(cursor * c, gh_gguf * g) {
    gh_status st;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        gh_gguf_tensor * t = &g->tensors[i];
        const uint8_t * s;
        uint64_t len;
        size_t at = c->pos;
        if ((st = rd_str(c, &s, &len, GGUF_MAX_KEY_LEN, "a tensor name")) != GH_OK) return st;
        if ((st = dup_name(c, s, len, &t->name, "tensor name", i, at)) != GH_OK) return st;
        uint64_t slot = hash_slot(g->tensor_hash, g->tensor_hash_cap, t->name, tensor_name_at, g);
        if (g->tensor_hash[slot] != 0)
            return perr(c, GH_ERR_FORMAT, "duplicate tensor name '%.200s'", t->name);
        g->tensor_hash[slot] = i + 1;

        uint32_t n_dims;
        if ((st = rd_u32(c, &n_dims, "a tensor's dimension count")) != GH_OK) return st;
        if (n_dims < 1 || n_dims > GH_GGUF_MAX_DIMS)
            return perr(c, GH_ERR_FORMAT, "tensor '%.200s': n_dims %u is not in 1..%d",
                        t->name, n_dims, GH_GGUF_MAX_DIMS);
        t->n_dims = (int) n_dims;
        uint64_t nelem = 1;
        for (int d = 0; d < GH_GGUF_MAX_DIMS; d++) t->ne[d] = 1;
        for (uint32_t d = 0; d < n_dims; d++) {
            uint64_t ne;
            if ((st = rd_uint(c, 8, &ne, "a tensor dimension")) != GH_OK) return st;
            if (ne > GGUF_MAX_NE)
                return perr(c, GH_ERR_FORMAT, "tensor '%.200s': dimension %u is %llu (max 2^62)",
                            t->name, d, (unsigned long long) ne);
            t->ne[d] = (int64_t) ne;
            if (!gh_mul_ok(nelem, ne, &nelem) || nelem > (uint64_t) INT64_MAX)
                return perr(c, GH_ERR_FORMAT, "tensor '%.200s': element count overflows", t->name);
        }
        uint32_t type;
        if ((st = rd_u32(c, &type, "a tensor type")) != GH_OK) return st;
        /* a type the runtime reads (the type table), or I32: index tensors, which the model
         * loader reads itself and never as a weight */
        const gh_type_traits * tt = type < GH_TYPE_COUNT ? gh_type_layout((int) type) : NULL;
        if (!tt || (!tt->to_float && type != GH_TYPE_I32))
            return perr(c, GH_ERR_UNSUPPORTED, "tensor '%.200s' has type %s (id %u), which this "
                        "runtime does not read (it reads %s)", t->name,
                        tt ? tt->name : "unknown", type, gh_types_read_list());
        t->type = (int) type;
        const uint64_t bs = (uint64_t) tt->block_size;
        if ((uint64_t) t->ne[0] % bs != 0)
            return perr(c, GH_ERR_FORMAT,
                        "tensor '%.200s': ne[0] = %lld is not a multiple of the %s block size %llu",
                        t->name, (long long) t->ne[0], tt->name, (unsigned long long) bs);
        if (!gh_mul_ok(nelem / bs, tt->type_size, &t->nbytes))
            return perr(c, GH_ERR_FORMAT, "tensor '%.200s': byte size overflows", t->name);
        if ((st = rd_uint(c, 8, &t->offset, "a tensor offset")) != GH_OK) return st;
        if (t->offset % g->alignment != 0)
            return perr(c, GH_ERR_FORMAT, "tensor '%.200s': offset %llu is not a multiple of the "
                        "alignment %u", t->name, (unsigned long long) t->offset, g->alignment);
    }
    return GH_OK;
}

typedef struct { uint64_t start, end, idx; } span;

static int span_cmp(const void * a, const void * b) {
    const span * x = a, * y = b;
    if (x->start != y->start) return x->start < y->start ? -1 : 1;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/* Every tensor's data must lie inside the image, and no two may overlap. */
static gh_status check_data(cursor * c, gh_gguf * g) {
    if (g->n_tensors == 0) return GH_OK;
    span * sp = malloc((size_t) g->n_tensors * sizeof *sp);
    if (!sp) return perr(c, GH_ERR_OOM, "out of memory checking %llu tensors",
                         (unsigned long long) g->n_tensors);
    gh_status st = GH_OK;
    for (uint64_t i = 0; i < g->n_tensors && st == GH_OK; i++) {
        gh_gguf_tensor * t = &g->tensors[i];
        uint64_t start, end;
        if (!gh_add_ok(g->data_offset, t->offset, &start) || !gh_add_ok(start, t->nbytes, &end) ||
            end > c->size) {
            st = perr(c, GH_ERR_FORMAT, "tensor '%.200s': data [%llu, +%llu) at data offset %llu "
                      "extends past the end of the file (%zu bytes)", t->name,
                      (unsigned long long) t->offset, (unsigned long long) t->nbytes,
                      (unsigned long long) g->data_offset, c->size);
            break;
        }
        t->data = c->base + start;
        sp[i] = (span) { t->offset, t->offset + t->nbytes, i };
    }
    if (st == GH_OK) {
        qsort(sp, (size_t) g->n_tensors, sizeof *sp, span_cmp);
        uint64_t prev_end = 0, prev = 0;
        bool have_prev = false;
        for (uint64_t i = 0; i < g->n_tensors; i++) {
            if (sp[i].start == sp[i].end) continue;  /* empty tensors overlap nothing */
            if (have_prev && sp[i].start < prev_end) {
                st = perr(c, GH_ERR_FORMAT, "tensors '%.200s' and '%.200s' overlap in the data section",
                          g->tensors[prev].name, g->tensors[sp[i].idx].name);
                break;
            }
            prev_end = sp[i].end;
            prev = sp[i].idx;
            have_prev = true;
        }
    }
    free(sp);
    return st;
}

/* ---- the whole image ---- */

static gh_status parse(cursor * c, gh_gguf * g) {
    gh_status st;
    if (c->size == 0) return perr(c, GH_ERR_FORMAT, "file is empty");
    g->pwri = c->size >= 4 && memcmp(c->base, "PWRI", 4) == 0; /* PowerInfer's patched magic */
    if (c->size < 4 || (memcmp(c->base, "GGUF", 4) != 0 && !g->pwri))
        return perr(c, GH_ERR_FORMAT, "not a GGUF file (bad magic; expected \"GGUF\", or "
                    "\"PWRI\" for PowerInfer's files)");
    c->pos = 4;
    if ((st = rd_u32(c, &g->version, "the version")) != GH_OK) return st;
    if (g->version != 2 && g->version != 3) {
        if (g->version == 1)
            return perr(c, GH_ERR_UNSUPPORTED, "GGUF version 1 is not supported (only 2 and 3)");
        if (g->version == 0x02000000u || g->version == 0x03000000u)
            return perr(c, GH_ERR_UNSUPPORTED, "big-endian GGUF files are not supported");
        return perr(c, GH_ERR_UNSUPPORTED, "unknown GGUF version %u (only 2 and 3 are supported)",
                    g->version);
    }
    if ((st = rd_uint(c, 8, &g->n_tensors, "the tensor count")) != GH_OK) return st;
    if ((st = rd_uint(c, 8, &g->n_kv, "the key count")) != GH_OK) return st;

    /* Bound both counts by the bytes that remain before allocating anything. */
    uint64_t need_kv, need_t, need;
    if (!gh_mul_ok(g->n_kv, GGUF_MIN_KV_BYTES, &need_kv) ||
        !gh_mul_ok(g->n_tensors, GGUF_MIN_TENSOR_BYTES, &need_t) ||
        !gh_add_ok(need_kv, need_t, &need) || !has(c, need))
        return perr(c, GH_ERR_FORMAT, "header claims %llu keys and %llu tensors, which cannot fit "
                    "in a file of %zu bytes", (unsigned long long) g->n_kv,
                    (unsigned long long) g->n_tensors, c->size);

    if (g->n_kv > 0) {
        g->kv = calloc((size_t) g->n_kv, sizeof *g->kv);
        g->kv_hash_cap = hash_cap(g->n_kv);
        g->kv_hash = calloc((size_t) g->kv_hash_cap, sizeof *g->kv_hash);
        if (!g->kv || !g->kv_hash)
            return perr(c, GH_ERR_OOM, "out of memory for %llu keys", (unsigned long long) g->n_kv);
    }
    if ((st = parse_kvs(c, g)) != GH_OK) return st;

    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    bool err = false;
    uint32_t align;
    if (gh_gguf_get_u32(g, "general.alignment", &align, &err)) {
        if (align == 0 || (align & (align - 1)) != 0)
            return perr(c, GH_ERR_FORMAT, "general.alignment = %u is not a power of two", align);
        g->alignment = align;
    } else if (err) {
        return perr(c, GH_ERR_FORMAT, "general.alignment: %s", gh_last_error());
    }

    if (g->n_tensors > 0) {
        g->tensors = calloc((size_t) g->n_tensors, sizeof *g->tensors);
        g->tensor_hash_cap = hash_cap(g->n_tensors);
        g->tensor_hash = calloc((size_t) g->tensor_hash_cap, sizeof *g->tensor_hash);
        if (!g->tensors || !g->tensor_hash)
            return perr(c, GH_ERR_OOM, "out of memory for %llu tensors",
                        (unsigned long long) g->n_tensors);
    }
    if ((st = parse_tensors(c, g)) != GH_OK) return st;

    /* The data section starts at the next multiple of the alignment. */
    uint64_t pad = (g->alignment - c->pos % g->alignment) % g->alignment;
    if (!gh_add_ok(c->pos, pad, &g->data_offset))
        return perr(c, GH_ERR_FORMAT, "data section offset overflows");
    return check_data(c, g);
}

static gh_status open_image(const uint8_t * data, size_t size, const char * label,
                            void * map, size_t map_size, int load, gh_gguf ** out) {
    gh_gguf * g = calloc(1, sizeof *g);
    if (!g) {
        if (map) munmap(map, map_size);
        return gh_fail(GH_ERR_OOM, "GGUF '%.200s': out of memory", label);
    }
    g->base = data;
    g->size = size;
    g->map = map;
    g->map_size = map_size;
    g->load = load;
    cursor c = { data, size, 0, label };
    gh_status st = parse(&c, g);
    if (st != GH_OK) {
        gh_gguf_close(g);
        return st;
    }
    *out = g;
    return GH_OK;
}

/* ---- public API ---- */

/* 1 if the kernel hands out transparent huge pages to a region that asks for them
 * (/sys/kernel/mm/transparent_hugepage/enabled is [always] or [madvise]). */
static bool thp_available(void) {
    FILE * f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f) return false;
    char buf[128] = { 0 };
    const bool ok = fgets(buf, sizeof buf, f) != NULL;
    fclose(f);
    return ok && (strstr(buf, "[always]") || strstr(buf, "[madvise]"));
}

/* MemAvailable of /proc/meminfo in bytes; 0 if unknown. */
static uint64_t mem_available(void) {
    FILE * f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
    }
    fclose(f);
    return (uint64_t) kb * 1024u;
}

#define GH_HUGE_PAGE ((size_t) 2 << 20)
#define GH_READ_MARGIN ((uint64_t) 1 << 30) /* memory auto mode leaves free after reading */

/* Reads the file into private anonymous memory aligned to and advised for 2 MiB pages
 * (GH_LOAD_READ). On success *raw / *raw_size are the region to unmap and *data the
 * file's first byte. With soft set, running out of memory returns GH_ERR_OOM without
 * setting an error message, so the caller can map the file instead. */
static gh_status read_image(int fd, size_t size, const char * path, bool soft, void ** raw,
                            size_t * raw_size, uint8_t ** data) {
    const size_t len = (size + GH_HUGE_PAGE - 1) & ~(GH_HUGE_PAGE - 1);
    if (len < size || len > SIZE_MAX - GH_HUGE_PAGE) {
        return gh_fail(GH_ERR_IO, "cannot read '%.200s' into memory: file too large", path);
    }
    const size_t total = len + GH_HUGE_PAGE; /* room to align the start */
    void * r = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (r == MAP_FAILED) {
        if (soft) return GH_ERR_OOM;
        return gh_fail(GH_ERR_OOM, "cannot read '%.200s' into memory: %s (%zu MiB; load it "
                       "mapped instead: load=mmap)", path, strerror(errno), size >> 20);
    }
    uint8_t * d = (uint8_t *) (((uintptr_t) r + GH_HUGE_PAGE - 1) & ~(uintptr_t) (GH_HUGE_PAGE - 1));
    /* Without huge pages the copy still works, only without the TLB saving. */
    (void) madvise(d, len, MADV_HUGEPAGE);
    size_t got = 0;
    while (got < size) {
        const ssize_t n = pread(fd, d + got, size - got, (off_t) got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            const int e = n < 0 ? errno : 0;
            munmap(r, total);
            return gh_fail(GH_ERR_IO, "cannot read '%.200s': %s", path,
                           e ? strerror(e) : "the file ended early (was it truncated while loading?)");
        }
        got += (size_t) n;
    }
    /* read-only like a mapping: a stray write faults instead of corrupting weights */
    (void) mprotect(r, total, PROT_READ);
    *raw = r;
    *raw_size = total;
    *data = d;
    return GH_OK;
}

gh_status gh_gguf_open(const char * path, gh_gguf ** out) {
    return gh_gguf_open_ex(path, GH_LOAD_MMAP, out);
}

gh_status gh_gguf_open_ex(const char * path, int load, gh_gguf ** out) {
    if (!out) return gh_fail(GH_ERR_INVALID_ARG, "gh_gguf_open: out is NULL");
    *out = NULL;
    if (!path) return gh_fail(GH_ERR_INVALID_ARG, "gh_gguf_open: path is NULL");
    if (load != GH_LOAD_AUTO && load != GH_LOAD_MMAP && load != GH_LOAD_READ) {
        return gh_fail(GH_ERR_INVALID_ARG, "unknown load mode %d (GH_LOAD_AUTO %d, GH_LOAD_MMAP "
                       "%d, GH_LOAD_READ %d)", load, GH_LOAD_AUTO, GH_LOAD_MMAP, GH_LOAD_READ);
    }
    /* O_NONBLOCK: opening a FIFO must not hang; it is then rejected as not regular. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return gh_fail(GH_ERR_IO, "cannot open '%.200s': %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return gh_fail(GH_ERR_IO, "cannot stat '%.200s': %s", path, strerror(e));
    }
    if (S_ISDIR(sb.st_mode)) {
        close(fd);
        return gh_fail(GH_ERR_IO, "cannot open '%.200s': is a directory, not a GGUF file", path);
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return gh_fail(GH_ERR_IO, "cannot open '%.200s': not a regular file", path);
    }
    if (sb.st_size == 0) {
        close(fd);
        return gh_fail(GH_ERR_FORMAT, "GGUF '%.200s': file is empty", path);
    }
    if ((uint64_t) sb.st_size > SIZE_MAX) {
        close(fd);
        return gh_fail(GH_ERR_IO, "cannot map '%.200s': file too large", path);
    }
    size_t size = (size_t) sb.st_size;
    const bool automatic = load == GH_LOAD_AUTO;
    const uint64_t avail = load == GH_LOAD_MMAP ? 0 : mem_available();
    if (automatic) {
        load = thp_available() && avail > GH_READ_MARGIN && (uint64_t) size < avail - GH_READ_MARGIN
                   ? GH_LOAD_READ : GH_LOAD_MMAP;
    } else if (load == GH_LOAD_READ && avail > 0 && (uint64_t) size > avail) {
        /* The copy's pages are only taken as the file is read: asking for more than the
         * machine has would end in the OOM killer, not in an error. */
        close(fd);
        return gh_fail(GH_ERR_OOM, "cannot read '%.200s' into memory: it needs %llu MiB and "
                       "%llu MiB are available (load it mapped instead: load=mmap)", path,
                       (unsigned long long) (size >> 20), (unsigned long long) (avail >> 20));
    }
    if (load == GH_LOAD_READ) {
        void * raw = NULL;
        size_t raw_size = 0;
        uint8_t * data = NULL;
        const gh_status st = read_image(fd, size, path, automatic, &raw, &raw_size, &data);
        if (st == GH_OK) {
            close(fd);
            return open_image(data, size, path, raw, raw_size, GH_LOAD_READ, out);
        }
        if (!(automatic && st == GH_ERR_OOM)) {
            close(fd);
            return st;
        }
        /* auto: no memory for a copy after all; map the file as before */
    }
    /* A file truncated by another process while mapped would fault on access (SIGBUS);
     * like every mmap-based loader, we assume model files are not rewritten in place. */
    void * map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return gh_fail(GH_ERR_IO, "cannot map '%.200s': %s", path, strerror(e));
    return open_image(map, size, path, map, size, GH_LOAD_MMAP, out);
}

gh_status gh_gguf_open_memory(const void * data, size_t size, gh_gguf ** out) {
    if (!out) return gh_fail(GH_ERR_INVALID_ARG, "gh_gguf_open_memory: out is NULL");
    *out = NULL;
    if (!data && size != 0) return gh_fail(GH_ERR_INVALID_ARG, "gh_gguf_open_memory: data is NULL");
    static const uint8_t empty[1];
    return open_image(data ? data : empty, size, "<memory>", NULL, 0, GH_LOAD_READ, out);
}

int32_t gh_gguf_load_mode(const gh_gguf * g) { return g ? g->load : GH_LOAD_MMAP; }

void gh_gguf_close(gh_gguf * g) {
    if (!g) return;
    if (g->kv)
        for (uint64_t i = 0; i < g->n_kv; i++) {
            free(g->kv[i].key);
            free(g->kv[i].str);
        }
    if (g->tensors)
        for (uint64_t i = 0; i < g->n_tensors; i++) free(g->tensors[i].name);
    free(g->kv);
    free(g->kv_hash);
    free(g->tensors);
    free(g->tensor_hash);
    if (g->map) munmap(g->map, g->map_size);
    free(g);
}

int64_t gh_gguf_n_kv(const gh_gguf * g) { return g ? (int64_t) g->n_kv : 0; }
int64_t gh_gguf_n_tensors(const gh_gguf * g) { return g ? (int64_t) g->n_tensors : 0; }

const char * gh_gguf_tensor_name(const gh_gguf * g, int64_t i) {
    if (!g || i < 0 || (uint64_t) i >= g->n_tensors) return NULL;
    return g->tensors[i].name;
}

/* ---- lookups and typed getters ---- */

static int64_t find_kv_index(const gh_gguf * g, const char * key) {
    if (!g || !key || !g->kv_hash) return -1;
    uint64_t slot = hash_slot(g->kv_hash, g->kv_hash_cap, key, kv_name_at, g);
    return g->kv_hash[slot] == 0 ? -1 : (int64_t) (g->kv_hash[slot] - 1);
}

const gh_gguf_kv * gh_gguf_find_kv(const gh_gguf * g, const char * key) {
    int64_t i = find_kv_index(g, key);
    return i < 0 ? NULL : &g->kv[i];
}

const gh_gguf_tensor * gh_gguf_find_tensor(const gh_gguf * g, const char * name) {
    if (!g || !name || !g->tensor_hash) return NULL;
    uint64_t slot = hash_slot(g->tensor_hash, g->tensor_hash_cap, name, tensor_name_at, g);
    return g->tensor_hash[slot] == 0 ? NULL : &g->tensors[g->tensor_hash[slot] - 1];
}

static bool is_unsigned(int t) {
    return t == GH_GGUF_UINT8 || t == GH_GGUF_UINT16 || t == GH_GGUF_UINT32 || t == GH_GGUF_UINT64;
}
static bool is_signed(int t) {
    return t == GH_GGUF_INT8 || t == GH_GGUF_INT16 || t == GH_GGUF_INT32 || t == GH_GGUF_INT64;
}
static bool is_float(int t) { return t == GH_GGUF_FLOAT32 || t == GH_GGUF_FLOAT64; }

static bool getter_fail(const gh_gguf_kv * kv, bool * err, const char * want) {
    gh_fail(GH_ERR_FORMAT, "key '%.200s': expected %s, found %s", kv->key, want,
            gh_gguf_vtype_name(kv->type));
    if (err) *err = true;
    return false;
}

bool gh_gguf_get_u32(const gh_gguf * g, const char * key, uint32_t * out, bool * err) {
    const gh_gguf_kv * kv = gh_gguf_find_kv(g, key);
    if (!kv) return false;
    bool ok;
    if (is_unsigned(kv->type)) ok = kv->v.u64 <= UINT32_MAX;
    else if (is_signed(kv->type)) ok = kv->v.i64 >= 0 && kv->v.i64 <= (int64_t) UINT32_MAX;
    else return getter_fail(kv, err, "an unsigned integer");
    if (!ok) {
        gh_fail(GH_ERR_FORMAT, "key '%.200s': value out of range for uint32", kv->key);
        if (err) *err = true;
        return false;
    }
    *out = is_unsigned(kv->type) ? (uint32_t) kv->v.u64 : (uint32_t) kv->v.i64;
    return true;
}

bool gh_gguf_get_f32(const gh_gguf * g, const char * key, float * out, bool * err) {
    const gh_gguf_kv * kv = gh_gguf_find_kv(g, key);
    if (!kv) return false;
    if (is_float(kv->type)) *out = (float) kv->v.f64;
    else if (is_unsigned(kv->type)) *out = (float) kv->v.u64;
    else if (is_signed(kv->type)) *out = (float) kv->v.i64;
    else return getter_fail(kv, err, "a number");
    return true;
}

bool gh_gguf_get_bool(const gh_gguf * g, const char * key, bool * out, bool * err) {
    const gh_gguf_kv * kv = gh_gguf_find_kv(g, key);
    if (!kv) return false;
    if (kv->type != GH_GGUF_BOOL) return getter_fail(kv, err, "a bool");
    *out = kv->v.u64 != 0;
    return true;
}

const char * gh_gguf_get_str(const gh_gguf * g, const char * key) {
    const gh_gguf_kv * kv = gh_gguf_find_kv(g, key);
    return kv && kv->type == GH_GGUF_STRING ? kv->str : NULL;
}

int64_t gh_gguf_get_arr_n(const gh_gguf * g, const char * key) {
    const gh_gguf_kv * kv = gh_gguf_find_kv(g, key);
    return kv && kv->type == GH_GGUF_ARRAY ? (int64_t) kv->arr_n : -1;
}

/* ---- public by-index inspection (tests, tools) ---- */

static const gh_gguf_kv * kv_at(const gh_gguf * g, int64_t i) {
    if (!g || i < 0 || (uint64_t) i >= g->n_kv) return NULL;
    return &g->kv[i];
}

const char * gh_gguf_kv_key(const gh_gguf * g, int64_t i) {
    const gh_gguf_kv * kv = kv_at(g, i);
    return kv ? kv->key : NULL;
}

int32_t gh_gguf_kv_type(const gh_gguf * g, int64_t i) {
    const gh_gguf_kv * kv = kv_at(g, i);
    return kv ? kv->type : -1;
}

int64_t gh_gguf_find_key(const gh_gguf * g, const char * key) { return find_kv_index(g, key); }

gh_status gh_gguf_kv_int(const gh_gguf * g, int64_t i, int64_t * out) {
    const gh_gguf_kv * kv = kv_at(g, i);
    if (!kv || !out) return gh_fail(GH_ERR_INVALID_ARG, "gh_gguf_kv_int: bad handle, index or out");
    if (is_signed(kv->type)) *out = kv->v.i64;
    else if (is_unsigned(kv->type) || kv->type == GH_GGUF_BOOL) {
        if (kv->v.u64 > (uint64_t) INT64_MAX)
            return gh_fail(GH_ERR_RANGE, "key '%.200s': value %llu does not fit in int64", kv->key,
                           (unsigned long long) kv->v.u64);
        *out = (int64_t) kv->v.u64;
    } else {
        return gh_fail(GH_ERR_INVALID_ARG, "key '%.200s': expected an integer or bool, found %s",
                       kv->key, gh_gguf_vtype_name(kv->type));
    }
    return GH_OK;
}

gh_status gh_gguf_kv_float(const gh_gguf * g, int64_t i, double * out) {
    const gh_gguf_kv * kv = kv_at(g, i);
    if (!kv || !out) return gh_fail(GH_ERR_INVALID_ARG, "gh_gguf_kv_float: bad handle, index or out");
    if (is_float(kv->type)) *out = kv->v.f64;
    else if (is_signed(kv->type)) *out = (double) kv->v.i64;
    else if (is_unsigned(kv->type)) *out = (double) kv->v.u64;
    else return gh_fail(GH_ERR_INVALID_ARG, "key '%.200s': expected a number, found %s", kv->key,
                        gh_gguf_vtype_name(kv->type));
    return GH_OK;
}

const char * gh_gguf_kv_str(const gh_gguf * g, int64_t i) {
    const gh_gguf_kv * kv = kv_at(g, i);
    return kv && kv->type == GH_GGUF_STRING ? kv->str : NULL;
}

int64_t gh_gguf_kv_arr(const gh_gguf * g, int64_t i, int32_t * elem_type) {
    const gh_gguf_kv * kv = kv_at(g, i);
    if (!kv || kv->type != GH_GGUF_ARRAY) return -1;
    if (elem_type) *elem_type = kv->arr_type;
    return (int64_t) kv->arr_n;
}

gh_status gh_gguf_kv_arr_data(const gh_gguf * g, int64_t i, const void ** data, uint64_t * nbytes) {
    const gh_gguf_kv * kv = kv_at(g, i);
    if (!kv || !data || !nbytes) return gh_fail(GH_ERR_INVALID_ARG, "gh_gguf_kv_arr_data: bad handle, index or out");
    if (kv->type != GH_GGUF_ARRAY)
        return gh_fail(GH_ERR_INVALID_ARG, "key '%.200s' is a %s, not an array", kv->key,
                       gh_gguf_vtype_name(kv->type));
    *data = kv->arr_data;
    *nbytes = kv->arr_bytes;
    return GH_OK;
}

gh_status gh_gguf_tensor_info(const gh_gguf * g, int64_t i, int32_t * type, int32_t * n_dims,
                              int64_t * ne, uint64_t * offset, uint64_t * nbytes,
                              const void ** data) {
    if (!g || i < 0 || (uint64_t) i >= g->n_tensors)
        return gh_fail(GH_ERR_INVALID_ARG, "gh_gguf_tensor_info: tensor index %lld out of range",
                       (long long) i);
    const gh_gguf_tensor * t = &g->tensors[i];
    if (type) *type = t->type;
    if (n_dims) *n_dims = t->n_dims;
    if (ne) for (int d = 0; d < GH_GGUF_MAX_DIMS; d++) ne[d] = t->ne[d];
    if (offset) *offset = t->offset;
    if (nbytes) *nbytes = t->nbytes;
    if (data) *data = t->data;
    return GH_OK;
}
