/* The registry of architectures: the one list the loader looks names up in. */
#include "model/arch.h"

#include <string.h>

static const gh_arch * const ARCHS[] = { &gh_arch_llama, &gh_arch_qwen2, &gh_arch_falcon,
                                         &gh_arch_opt, &gh_arch_phi3, &gh_arch_qwen3,
                                         &gh_arch_olmo2, &gh_arch_smollm3, &gh_arch_gemma2,
                                         &gh_arch_gemma3, &gh_arch_qwen2moe, &gh_arch_qwen3moe,
                                         &gh_arch_olmoe, &gh_arch_gptoss, &gh_arch_glm4moe,
                                         &gh_arch_dots1 };

const gh_arch * gh_arch_find(const char * name) {
    for (size_t i = 0; name && i < sizeof ARCHS / sizeof ARCHS[0]; i++) {
        if (!strcmp(ARCHS[i]->name, name)) return ARCHS[i];
    }
    return NULL;
}

const char * gh_arch_names(void) {
    static char names[256];
    if (!names[0]) {
        for (size_t i = 0; i < sizeof ARCHS / sizeof ARCHS[0]; i++) {
            if (i) strcat(names, ", ");
            strcat(names, ARCHS[i]->name);
        }
    }
    return names;
}
