/* GGUF v3 reader. The file is untrusted: every count, length and offset is checked
 * against the real file size before use, and nothing is allocated in proportion to a
 * declared count before that count has been shown to fit in the file. */
#ifndef GH_GGUF_H
#define GH_GGUF_H

#include "core/common.h"

enum gh_gguf_vtype {
    GH_GGUF_UINT8 = 0, GH_GGUF_INT8 = 1, GH_GGUF_UINT16 = 2, GH_GGUF_INT16 = 3,
    GH_GGUF_UINT32 = 4, GH_GGUF_INT32 = 5, GH_GGUF_FLOAT32 = 6, GH_GGUF_BOOL = 7,
    GH_GGUF_STRING = 8, GH_GGUF_ARRAY = 9, GH_GGUF_UINT64 = 10, GH_GGUF_INT64 = 11,
    GH_GGUF_FLOAT64 = 12,
};

#define GH_GGUF_MAX_DIMS 4

typedef struct {
    char *   key;       /* NUL-terminated copy */
    int      type;      /* gh_gguf_vtype */
    /* scalars (integers widened; bool as 0/1) */
    union { uint64_t u64; int64_t i64; double f64; } v;
    /* strings: NUL-terminated copy (embedded NULs are rejected) */
    char *   str;
    uint64_t str_len;
    /* arrays: element type, count, and where the elements start in the file image.
     * Array-of-string elements are left unparsed (validated, not copied). */
    int      arr_type;
    uint64_t arr_n;
    const uint8_t * arr_data;
    uint64_t arr_bytes; /* bytes of the elements (string arrays: u64 length + bytes each) */
} gh_gguf_kv;

typedef struct {
    char *       name;      /* NUL-terminated copy */
    int          type;      /* gh_type; only known types are accepted */
    int          n_dims;
    int64_t      ne[GH_GGUF_MAX_DIMS]; /* ne[0] is the contiguous dimension; unused = 1 */
    uint64_t     offset;    /* relative to the data section */
    uint64_t     nbytes;
    const void * data;      /* inside the mapped file, checked to be in bounds */
} gh_gguf_tensor;

struct gh_gguf {
    const uint8_t * base;   /* file image */
    size_t          size;
    void *          map;    /* region to munmap: the file's mapping or its in-memory copy
                             * (NULL for memory images) */
    size_t          map_size;
    int             load;   /* GH_LOAD_MMAP or GH_LOAD_READ: how the image was made */
    uint32_t        version;
    bool            pwri;   /* PowerInfer's files: a GGUF whose magic is "PWRI" */
    uint32_t        alignment;
    uint64_t        data_offset;
    uint64_t        n_kv;
    gh_gguf_kv *    kv;
    uint64_t        n_tensors;
    gh_gguf_tensor * tensors;
    /* open-addressing name -> index+1 tables (0 = empty slot), capacity a power of 2 */
    uint64_t *      kv_hash;
    uint64_t        kv_hash_cap;
    uint64_t *      tensor_hash;
    uint64_t        tensor_hash_cap;
};

const gh_gguf_kv * gh_gguf_find_kv(const gh_gguf * g, const char * key);
const gh_gguf_tensor * gh_gguf_find_tensor(const gh_gguf * g, const char * name);

/* Typed getters: return false if the key is absent; a key present with a type that
 * cannot represent the request (string for a number, negative for unsigned, out of
 * range) sets an error message and returns false with *err = true. */
bool gh_gguf_get_u32(const gh_gguf * g, const char * key, uint32_t * out, bool * err);
bool gh_gguf_get_f32(const gh_gguf * g, const char * key, float * out, bool * err);
bool gh_gguf_get_bool(const gh_gguf * g, const char * key, bool * out, bool * err);
/* NULL if absent or not a string. */
const char * gh_gguf_get_str(const gh_gguf * g, const char * key);
/* Element count of an array key; -1 if absent or not an array. */
int64_t gh_gguf_get_arr_n(const gh_gguf * g, const char * key);

/* Name of a GGUF value type ("uint32", "string", ...); "unknown" for a bad id. */
const char * gh_gguf_vtype_name(int type);


#endif
