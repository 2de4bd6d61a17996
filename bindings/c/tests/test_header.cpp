// The header compiles as C++17 (and beside kernels/kvguard.cuh's host-visible names: no clash),
// and a C++ caller links against the static library. Built and run by scripts/ci/c.sh.
#include "kvguard.h"

#include <cstdio>
#include <cstring>

int main() {
    kvg_pool_config config{};
    if (kvg_pool_config_init(&config, sizeof config) != KVG_STATUS_OK) return 1;
    config.num_pages = 8;
    config.page_size = 16;
    config.max_context_tokens = 64;
    kvg_table *table = nullptr;
    if (kvg_table_new(&config, &table) != KVG_STATUS_OK) return 1;
    kvg_status s = kvg_admit(table, 1, 1, 16, 0);
    kvg_table_free(table);
    std::printf("C++17: %s, kvguard %s\n", kvg_status_name(s), kvg_version());
    return s == KVG_STATUS_OK && std::strcmp(kvg_violation_kind_name(KVG_VIOLATION_KIND_FOREIGN_PAGE), "foreign_page") == 0 ? 0 : 1;
}
