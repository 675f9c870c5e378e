/* What every backend shares (backend.h): freeing one, and the refusal of a weight type it
 * does not read, naming the types it does. The registry of backends by name is
 * registry.c; this file knows none of them. */
#include "backend/backend.h"
#include "types/types.h"

#include <stdio.h>

void gh_backend_free(gh_backend * b) {
    if (b) b->ops->destroy(b);
}

const char * gh_backend_types_read(const gh_backend * b, char * buf, size_t cap) {
    int n = 0, k = 0;
    for (int t = 0; t < GH_TYPE_COUNT; t++) n += gh_type_traits_get(t) && b->ops->reads_type(b, t);
    size_t len = 0;
    buf[0] = 0;
    for (int t = 0; t < GH_TYPE_COUNT && len < cap; t++) {
        if (!gh_type_traits_get(t) || !b->ops->reads_type(b, t)) continue;
        const char * sep = k == 0 ? "" : k + 1 < n ? ", " : " and ";
        len += (size_t) snprintf(buf + len, cap - len, "%s%s", sep, gh_type_traits_get(t)->name);
        k++;
    }
    if (n == 0) snprintf(buf, cap, "none");
    return buf;
}

gh_status gh_backend_check_type(const gh_backend * b, const char * device, const char * what,
                                int type, const char * hint) {
    if (b->ops->reads_type(b, type)) return GH_OK;
    char list[512];
    return gh_fail(GH_ERR_UNSUPPORTED, "device '%s' does not read type %s (id %d) of %s: it "
                   "reads %s%s%s", device, gh_type_name(type), type, what,
                   gh_backend_types_read(b, list, sizeof list), hint ? "; " : "", hint ? hint : "");
}
