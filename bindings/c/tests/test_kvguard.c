/*
 * The C ABI's test: every function, NULL pointers, bad struct sizes and every violation kind the
 * ownership table can raise, through include/kvguard.h and the static library; transfers
 * (manifests, the receiver) and import tickets; several threads on one table. Built and run by
 * scripts/ci/c.sh (cc -std=c11 -pthread -Wall -Wextra -Werror). Prints "N passed, N failed";
 * exits 1 on a failure.
 */
#include "kvguard.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static atomic_int passed, failed;

#define CHECK(cond)                                                                        \
    do {                                                                                   \
        if (cond) {                                                                        \
            passed++;                                                                      \
        } else {                                                                           \
            failed++;                                                                      \
            fprintf(stderr, "FAIL %s:%d: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
                    kvg_last_error_message());                                             \
        }                                                                                  \
    } while (0)

/* The call returned `status`. */
#define EXPECT(call, status) CHECK((call) == (status))
#define OK(call) EXPECT(call, KVG_STATUS_OK)

enum { PAGES = 64, PS = 16, MAX_CONTEXT = 256 };

static const int32_t NULL_PAGE[1] = {0};

static kvg_table *new_table(uint32_t policy, uint32_t scrub) {
    kvg_pool_config config;
    kvg_table *table = NULL;
    OK(kvg_pool_config_init(&config, sizeof config));
    config.num_pages = PAGES;
    config.page_size = PS;
    config.max_context_tokens = MAX_CONTEXT;
    config.reserved = NULL_PAGE;
    config.num_reserved = 1;
    config.policy = policy;
    config.scrub_on_release = scrub;
    OK(kvg_table_new(&config, &table));
    CHECK(table != NULL);
    return table;
}

/* The kind of the thread's last violation `index` (0 if none). */
static uint32_t last_kind(size_t index) {
    kvg_violation_info info;
    info.struct_size = sizeof info;
    if (kvg_last_violation(index, &info) != KVG_STATUS_OK) return 0;
    return info.kind;
}

static kvg_violation_info last_info(void) {
    kvg_violation_info info;
    memset(&info, 0, sizeof info);
    info.struct_size = sizeof info;
    if (kvg_last_violation(0, &info) != KVG_STATUS_OK) info.kind = 0;
    return info;
}

/* `call` was refused as a violation of `kind`. */
#define VIOLATES(call, kind)                                                                 \
    do {                                                                                     \
        EXPECT(call, KVG_STATUS_VIOLATION);                                                  \
        CHECK(last_kind(0) == (uint32_t)(kind));                                             \
        CHECK(kvg_last_status() == KVG_STATUS_VIOLATION);                                    \
        CHECK(strstr(kvg_last_error_message(), kvg_violation_kind_name(kind)) != NULL);       \
    } while (0)

static void test_names_and_version(void) {
    CHECK(strcmp(kvg_version(), "0.1.0") == 0);
    CHECK(kvg_abi_version() == KVG_ABI_VERSION && KVG_ABI_VERSION == 2);
    CHECK(strcmp(kvg_status_name(KVG_STATUS_OK), "ok") == 0);
    CHECK(strcmp(kvg_status_name(KVG_STATUS_BAD_STRUCT_SIZE), "bad_struct_size") == 0);
    CHECK(strcmp(kvg_status_name(KVG_STATUS_OTHER), "other") == 0);
    CHECK(strcmp(kvg_status_name(999), "unknown") == 0);
    /* Every kind has its core name, the transfer and device ones included. */
    static const struct { uint32_t kind; const char *name; } kinds[] = {
        {KVG_VIOLATION_KIND_POOL_TOO_SMALL, "pool_too_small"},
        {KVG_VIOLATION_KIND_EXCEEDS_MAX_CONTEXT, "exceeds_max_context"},
        {KVG_VIOLATION_KIND_EXCEEDS_POOL, "exceeds_pool"},
        {KVG_VIOLATION_KIND_DUPLICATE_REQUEST, "duplicate_request"},
        {KVG_VIOLATION_KIND_UNKNOWN_REQUEST, "unknown_request"},
        {KVG_VIOLATION_KIND_DOUBLE_FREE, "double_free"},
        {KVG_VIOLATION_KIND_PAGE_NOT_FREE, "page_not_free"},
        {KVG_VIOLATION_KIND_PAGE_OUT_OF_RANGE, "page_out_of_range"},
        {KVG_VIOLATION_KIND_RESERVED_PAGE, "reserved_page"},
        {KVG_VIOLATION_KIND_FOREIGN_PAGE, "foreign_page"},
        {KVG_VIOLATION_KIND_FREED_PAGE, "freed_page"},
        {KVG_VIOLATION_KIND_UNWRITTEN_SLOTS, "unwritten_slots"},
        {KVG_VIOLATION_KIND_SLOT_OUT_OF_RANGE, "slot_out_of_range"},
        {KVG_VIOLATION_KIND_WRITE_TO_SHARED, "write_to_shared"},
        {KVG_VIOLATION_KIND_DUPLICATE_PREFIX, "duplicate_prefix"},
        {KVG_VIOLATION_KIND_UNKNOWN_PREFIX, "unknown_prefix"},
        {KVG_VIOLATION_KIND_CROSS_TENANT_SHARE, "cross_tenant_share"},
        {KVG_VIOLATION_KIND_EVICT_IN_USE, "evict_in_use"},
        {KVG_VIOLATION_KIND_TOKEN_COUNT_MISMATCH, "token_count_mismatch"},
        {KVG_VIOLATION_KIND_STALE_PAGE, "stale_page"},
        {KVG_VIOLATION_KIND_QUARANTINED, "quarantined"},
        {KVG_VIOLATION_KIND_BLOCK_TABLE_TOO_SHORT, "block_table_too_short"},
        {KVG_VIOLATION_KIND_PAGE_SHARED, "page_shared"},
        {KVG_VIOLATION_KIND_TRANSFER_MISROUTED, "transfer_misrouted"},
        {KVG_VIOLATION_KIND_TRANSFER_PAGES_MISMATCH, "transfer_pages_mismatch"},
        {KVG_VIOLATION_KIND_PROMPT_DIGEST_MISMATCH, "prompt_digest_mismatch"},
        {KVG_VIOLATION_KIND_PAGE_CHECKSUM_MISMATCH, "page_checksum_mismatch"},
        {KVG_VIOLATION_KIND_PAGE_LENGTH_MISMATCH, "page_length_mismatch"},
        {KVG_VIOLATION_KIND_MISSING_CHECKSUM, "missing_checksum"},
        {KVG_VIOLATION_KIND_MANIFEST_CORRUPT, "manifest_corrupt"},
        {KVG_VIOLATION_KIND_CANARY_MISMATCH, "canary_mismatch"},
        {KVG_VIOLATION_KIND_IMPORT_IN_FLIGHT, "import_in_flight"},
        {KVG_VIOLATION_KIND_TOKEN_RANGE_REVERSED, "token_range_reversed"},
        {KVG_VIOLATION_KIND_LANDING_FAILED, "landing_failed"},
    };
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        CHECK(strcmp(kvg_violation_kind_name(kinds[i].kind), kinds[i].name) == 0);
    }
    CHECK(strcmp(kvg_violation_kind_name(0), "unknown") == 0);
    CHECK(strcmp(kvg_violation_kind_name(KVG_VIOLATION_KIND_LANDING_FAILED + 1), "unknown") == 0);
}

static void test_config_and_sizes(void) {
    kvg_pool_config config;
    kvg_table *table = (kvg_table *)&config; /* must be reset to NULL on failure */

    OK(kvg_pool_config_init(&config, sizeof config));
    CHECK(config.struct_size == sizeof config && config.policy == KVG_POLICY_ENFORCE);
    CHECK(config.generation_limit == 0 && config.reserved == NULL && config.scrub_on_release == 0);
    EXPECT(kvg_pool_config_init(NULL, sizeof config), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_pool_config_init(&config, sizeof config - 1), KVG_STATUS_BAD_STRUCT_SIZE);

    /* The incident's pool fails the audit, naming both numbers. */
    OK(kvg_pool_config_init(&config, sizeof config));
    config.num_pages = 10645;
    config.page_size = 64;
    config.max_context_tokens = 1048576;
    EXPECT(kvg_pool_config_audit(&config), KVG_STATUS_CONFIG_INVALID);
    CHECK(strstr(kvg_last_error_message(), "681,280") != NULL);
    CHECK(strstr(kvg_last_error_message(), "1,048,576") != NULL);
    CHECK(kvg_last_violation_count() == 0);
    EXPECT(kvg_table_new(&config, &table), KVG_STATUS_CONFIG_INVALID);
    CHECK(table == NULL);
    /* Unaudited, it is built, and admission refuses what cannot fit. */
    OK(kvg_table_new_unaudited(&config, &table));
    CHECK(table != NULL);
    VIOLATES(kvg_admit(table, 1, 1, 1048576, 0), KVG_VIOLATION_KIND_EXCEEDS_POOL);
    kvg_table_free(table);
    /* A success clears the thread's last error. */
    CHECK(kvg_last_status() == KVG_STATUS_VIOLATION);
    OK(kvg_pool_config_init(&config, sizeof config));
    CHECK(kvg_last_status() == KVG_STATUS_OK && strcmp(kvg_last_error_message(), "") == 0);

    config.num_pages = 0;
    config.page_size = PS;
    config.max_context_tokens = 16;
    EXPECT(kvg_pool_config_audit(&config), KVG_STATUS_CONFIG_INVALID);
    config.num_pages = 4;
    OK(kvg_pool_config_audit(&config));
    config.policy = 7;
    EXPECT(kvg_pool_config_audit(&config), KVG_STATUS_INVALID_ARGUMENT);
    config.policy = KVG_POLICY_REPORT;
    OK(kvg_pool_config_audit(&config));
    config.generation_limit = 1;
    EXPECT(kvg_pool_config_audit(&config), KVG_STATUS_CONFIG_INVALID);
    config.generation_limit = 0;
    config.num_reserved = 2; /* reserved is NULL */
    EXPECT(kvg_pool_config_audit(&config), KVG_STATUS_NULL_POINTER);
    config.num_reserved = 0;
    EXPECT(kvg_pool_config_audit(NULL), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_table_new(NULL, &table), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_table_new(&config, NULL), KVG_STATUS_NULL_POINTER);
    /* A reserved page beyond the pool, and a negative one, are refused. */
    {
        int32_t bad[1] = {-1};
        config.reserved = bad;
        config.num_reserved = 1;
        EXPECT(kvg_pool_config_audit(&config), KVG_STATUS_CONFIG_INVALID);
        config.reserved = NULL;
        config.num_reserved = 0;
    }

    /* struct_size: too small, absurd, larger with unknown fields set, larger with them zero. */
    {
        struct {
            kvg_pool_config config;
            uint64_t newer_fields[4];
        } grown;
        memset(&grown, 0, sizeof grown);
        grown.config = config;
        config.struct_size = sizeof config - 8;
        EXPECT(kvg_pool_config_audit(&config), KVG_STATUS_BAD_STRUCT_SIZE);
        CHECK(strstr(kvg_last_error_message(), "struct_size") != NULL);
        config.struct_size = 1u << 20;
        EXPECT(kvg_pool_config_audit(&config), KVG_STATUS_BAD_STRUCT_SIZE);
        config.struct_size = 0;
        EXPECT(kvg_pool_config_audit(&config), KVG_STATUS_BAD_STRUCT_SIZE);
        config.struct_size = sizeof config;
        grown.config.struct_size = sizeof grown;
        OK(kvg_pool_config_audit(&grown.config));
        grown.newer_fields[2] = 1;
        EXPECT(kvg_pool_config_audit(&grown.config), KVG_STATUS_BAD_STRUCT_SIZE);
    }
}

/* A caller built against a newer header: its structs are larger, and a newer field it sets is
   refused by this library, never silently ignored. `kvg_pool_config_init` keeps the caller's
   `struct_size` (it used to write this library's, which hid the newer fields). */
static void test_newer_callers(void) {
    struct {
        kvg_pool_config config;
        uint64_t newer_field;
    } grown;
    kvg_table *table = NULL;

    memset(&grown, 0xab, sizeof grown);
    OK(kvg_pool_config_init(&grown.config, sizeof grown));
    CHECK(grown.config.struct_size == sizeof grown);
    CHECK(grown.newer_field == 0); /* zeroed: the newer field's default */
    CHECK(grown.config.policy == KVG_POLICY_ENFORCE && grown.config.reserved == NULL);
    grown.config.num_pages = PAGES;
    grown.config.page_size = PS;
    grown.config.max_context_tokens = MAX_CONTEXT;
    /* Zero trailing bytes: the newer field left at its default, accepted. */
    OK(kvg_table_new(&grown.config, &table));
    CHECK(table != NULL);
    kvg_table_free(table);
    /* A newer field set: refused, with a message, and no table. */
    grown.newer_field = 7;
    table = NULL;
    EXPECT(kvg_table_new(&grown.config, &table), KVG_STATUS_BAD_STRUCT_SIZE);
    CHECK(table == NULL);
    CHECK(strstr(kvg_last_error_message(), "does not know") != NULL);
    EXPECT(kvg_pool_config_audit(&grown.config), KVG_STATUS_BAD_STRUCT_SIZE);

    /* Too small for the first version: refused, and nothing written (not even struct_size). */
    memset(&grown, 0xab, sizeof grown);
    EXPECT(kvg_pool_config_init(&grown.config, sizeof grown.config - 8), KVG_STATUS_BAD_STRUCT_SIZE);
    CHECK(strstr(kvg_last_error_message(), "struct_size") != NULL);
    EXPECT(kvg_pool_config_init(&grown.config, 4), KVG_STATUS_BAD_STRUCT_SIZE);
    CHECK(grown.config.num_pages == 0xabababab);
    EXPECT(kvg_pool_config_init(&grown.config, 1u << 20), KVG_STATUS_BAD_STRUCT_SIZE);

    /* An in-out struct passed again keeps the caller's struct_size, so a newer in-field set
       between calls is still refused. */
    {
        struct {
            kvg_released released;
            uint64_t newer_field;
        } rel;
        kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
        kvg_page_ref refs[2];
        memset(&rel, 0, sizeof rel);
        rel.released.struct_size = sizeof rel;
        OK(kvg_admit(t, 1, 1, PS, 0));
        OK(kvg_allocate(t, 1, 2, refs, 2));
        OK(kvg_release_pages(t, 1, &refs[0].page, 1, &rel.released));
        CHECK(rel.released.ended == 1 && rel.released.struct_size == sizeof rel);
        rel.newer_field = 1;
        EXPECT(kvg_release(t, 1, &rel.released), KVG_STATUS_BAD_STRUCT_SIZE);
        rel.newer_field = 0;
        OK(kvg_release(t, 1, &rel.released));
        CHECK(rel.released.ended == 1);
        kvg_table_free(t);
    }
}

static void test_null_table_and_pointers(void) {
    kvg_pool_snapshot snap;
    uint64_t n = 0;
    snap.struct_size = sizeof snap;
    EXPECT(kvg_admit(NULL, 1, 1, 1, 1), KVG_STATUS_NULL_POINTER);
    CHECK(strstr(kvg_last_error_message(), "NULL") != NULL);
    EXPECT(kvg_snapshot(NULL, &snap), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_verify_step(NULL, 0, NULL, NULL, 0, 0, NULL, NULL), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_violation_count(NULL, 0, &n), KVG_STATUS_NULL_POINTER);
    kvg_table_free(NULL);

    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    OK(kvg_admit(t, 1, 1, 32, 0));
    EXPECT(kvg_snapshot(t, NULL), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_verify_read(t, 1, NULL, 2, 32), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_claim(t, 1, NULL, 1, NULL, 0), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_allocate(t, 1, 1, NULL, 1), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_violation_count(t, 0, NULL), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_last_violation(0, NULL), KVG_STATUS_INVALID_ARGUMENT); /* none left: the NULL failed first */
    EXPECT(kvg_publish_prefix(t, 1, NULL, 3, NULL, 0), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_publish_prefix(t, 1, (const uint8_t *)"k", 0, NULL, 0), KVG_STATUS_INVALID_ARGUMENT);
    EXPECT(kvg_confirm_scrubbed(t, NULL, 1), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_record_step_writes(t, 1, NULL, NULL, 0, NULL, NULL), KVG_STATUS_NULL_POINTER);
    /* Zero-length arrays may be NULL. */
    OK(kvg_verify_read(t, 1, NULL, 0, 0));
    OK(kvg_verify_step(t, 0, NULL, NULL, 0, 0, NULL, NULL));
    /* A misaligned array is refused. */
    {
        int32_t buf[4] = {1, 2, 3, 4};
        const int32_t *odd = (const int32_t *)((const char *)buf + 1);
        EXPECT(kvg_verify_read(t, 1, odd, 2, 32), KVG_STATUS_INVALID_ARGUMENT);
    }
    /* Output structs: too small, absurd. */
    snap.struct_size = sizeof snap - 8;
    EXPECT(kvg_snapshot(t, &snap), KVG_STATUS_BAD_STRUCT_SIZE);
    snap.struct_size = 100000;
    EXPECT(kvg_snapshot(t, &snap), KVG_STATUS_BAD_STRUCT_SIZE);
    /* A newer caller's larger struct: filled up to what this library knows, the rest zeroed. */
    {
        struct {
            kvg_pool_snapshot snap;
            uint64_t newer[2];
        } grown;
        memset(&grown, 0xff, sizeof grown);
        grown.snap.struct_size = sizeof grown;
        OK(kvg_snapshot(t, &grown.snap));
        CHECK(grown.snap.struct_size == sizeof(kvg_pool_snapshot));
        CHECK(grown.newer[0] == 0 && grown.newer[1] == 0);
        CHECK(grown.snap.total_pages == PAGES && grown.snap.requests == 1);
    }
    kvg_table_free(t);
}

/* Allocator mode: allocate, write, read, release, the snapshot and infos along the way. */
static void test_allocator_mode(void) {
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    kvg_page_ref refs[4];
    int32_t bt[4];
    kvg_pool_snapshot snap;
    kvg_page_info page;
    kvg_request_info req;
    kvg_released released;

    OK(kvg_admit(t, 1, 10, 40, 8));
    EXPECT(kvg_allocate(t, 1, 3, refs, 2), KVG_STATUS_BUFFER_TOO_SMALL);
    OK(kvg_allocate(t, 1, 3, refs, 4));
    for (int i = 0; i < 3; i++) {
        bt[i] = refs[i].page;
        CHECK(refs[i].page > 0 && refs[i].generation == 1);
    }
    OK(kvg_record_write_tokens(t, 1, bt, 3, 0, 40));
    OK(kvg_verify_read(t, 1, bt, 3, 40));
    OK(kvg_check_read(t, 1, bt, 3, 40));
    OK(kvg_verify_read_refs(t, 1, refs, 3, 40));
    OK(kvg_check_read_refs(t, 1, refs, 3, 40));
    OK(kvg_record_write(t, 1, bt[2], 8, 10));
    OK(kvg_verify_read(t, 1, bt, 3, 42));

    snap.struct_size = sizeof snap;
    OK(kvg_snapshot(t, &snap));
    CHECK(snap.total_pages == PAGES && snap.owned == 3 && snap.reserved == 1 && snap.free == PAGES - 4);
    CHECK(snap.requests == 1 && snap.violations == 0);

    page.struct_size = sizeof page;
    OK(kvg_get_page_info(t, bt[0], &page));
    CHECK(page.state == KVG_PAGE_STATE_OWNED && page.owner == 1 && page.tenant == 10);
    CHECK((page.fields & KVG_FIELD_OWNER) && page.written_prefix == PS && page.generation == 1);
    OK(kvg_get_page_info(t, 0, &page));
    CHECK(page.state == KVG_PAGE_STATE_RESERVED);
    EXPECT(kvg_get_page_info(t, PAGES, &page), KVG_STATUS_INVALID_ARGUMENT);
    EXPECT(kvg_get_page_info(t, -1, &page), KVG_STATUS_INVALID_ARGUMENT);

    req.struct_size = sizeof req;
    OK(kvg_get_request_info(t, 1, &req));
    CHECK(req.tenant == 10 && req.prompt_tokens == 40 && req.max_new_tokens == 8 && req.owned_pages == 3);
    CHECK(req.quarantined == 0 && req.prefixes == 0);
    EXPECT(kvg_get_request_info(t, 2, &req), KVG_STATUS_INVALID_ARGUMENT);

    /* Pool exhausted: a typed status, not a violation. */
    OK(kvg_admit(t, 2, 10, 16, 0));
    {
        kvg_page_ref many[PAGES];
        EXPECT(kvg_allocate(t, 2, PAGES, many, PAGES), KVG_STATUS_OUT_OF_PAGES);
        CHECK(kvg_last_violation_count() == 0);
    }

    /* Sliding window, then the rest. */
    memset(&released, 0, sizeof released);
    released.struct_size = sizeof released;
    OK(kvg_release_pages(t, 1, bt, 1, &released));
    CHECK(released.ended == 1 && released.scrub_len == 0);
    OK(kvg_release(t, 1, &released));
    CHECK(released.ended == 2);
    OK(kvg_release(t, 2, NULL));
    released.struct_size = 3;
    EXPECT(kvg_release(t, 2, &released), KVG_STATUS_BAD_STRUCT_SIZE);
    /* Checked before the release: request 2 was released above, so this is the double free. */
    released.struct_size = sizeof released;
    VIOLATES(kvg_release(t, 2, &released), KVG_VIOLATION_KIND_DOUBLE_FREE);
    kvg_table_free(t);
}

/* Shadow mode: claim, preempt, fork, import, scrub on release. */
static void test_shadow_mode_and_scrub(void) {
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 1);
    const int32_t pages[2] = {5, 6};
    kvg_page_ref refs[2], scrub[4];
    kvg_released released;

    OK(kvg_admit(t, 1, 1, 32, 0));
    OK(kvg_claim(t, 1, pages, 2, refs, 2));
    CHECK(refs[0].page == 5 && refs[1].page == 6 && refs[0].generation == 1);
    OK(kvg_record_import(t, 1, pages, 2, 32, 32));
    OK(kvg_verify_read(t, 1, pages, 2, 32));

    /* Fork: the child reads the parent's pages, now shared. */
    OK(kvg_fork(t, 1, 2));
    OK(kvg_verify_read(t, 2, pages, 2, 32));
    OK(kvg_release(t, 2, NULL));

    /* Preempt keeps the request; its pages await a scrub. */
    memset(&released, 0, sizeof released);
    released.struct_size = sizeof released;
    released.scrub = scrub;
    released.scrub_capacity = 1; /* too small: the preemption still happens */
    EXPECT(kvg_preempt(t, 1, &released), KVG_STATUS_BUFFER_TOO_SMALL);
    CHECK(released.ended == 2 && released.scrub_len == 2);
    {
        kvg_page_info info;
        info.struct_size = sizeof info;
        OK(kvg_get_page_info(t, 6, &info));
        CHECK(info.state == KVG_PAGE_STATE_AWAITING_SCRUB && info.generation == 2);
    }
    {
        kvg_page_ref both[2] = {{5, 1}, {6, 1}};
        kvg_page_ref wrong[1] = {{5, 2}};
        kvg_page_ref negative[1] = {{-5, 1}};
        EXPECT(kvg_confirm_scrubbed(t, wrong, 1), KVG_STATUS_NOT_AWAITING_SCRUB);
        EXPECT(kvg_confirm_scrubbed(t, negative, 1), KVG_STATUS_NOT_AWAITING_SCRUB);
        OK(kvg_confirm_scrubbed(t, both, 2));
        EXPECT(kvg_confirm_scrubbed(t, both, 2), KVG_STATUS_NOT_AWAITING_SCRUB);
    }
    {
        kvg_request_info req;
        req.struct_size = sizeof req;
        OK(kvg_get_request_info(t, 1, &req));
        CHECK(req.owned_pages == 0);
    }
    /* Claim again after the scrub, release with room for the whole list. */
    OK(kvg_claim(t, 1, pages, 2, NULL, 0));
    released.scrub_capacity = 4;
    OK(kvg_release(t, 1, &released));
    CHECK(released.scrub_len == 2 && scrub[0].generation == 2);
    OK(kvg_confirm_scrubbed(t, scrub, released.scrub_len));
    kvg_table_free(t);
}

static void test_prefixes(void) {
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    const uint8_t key[] = {0xde, 0xad, 0x00, 0xbe, 0xef}; /* bytes, NUL included */
    const int32_t pages[2] = {3, 4};
    kvg_page_ref refs[2];
    size_t n = 0;
    kvg_released released;

    OK(kvg_admit(t, 1, 7, 32, 0));
    OK(kvg_admit(t, 2, 7, 32, 0));
    OK(kvg_admit(t, 3, 8, 32, 0));
    OK(kvg_claim(t, 1, pages, 2, NULL, 0));
    OK(kvg_record_write_tokens(t, 1, pages, 2, 0, 32));
    OK(kvg_publish_prefix(t, 1, key, sizeof key, pages, 2));
    EXPECT(kvg_attach_prefix(t, 2, key, sizeof key, refs, 1, &n), KVG_STATUS_BUFFER_TOO_SMALL);
    CHECK(n == 2);
    OK(kvg_detach_prefix(t, 2, key, sizeof key, NULL));
    OK(kvg_attach_prefix(t, 2, key, sizeof key, refs, 2, &n));
    CHECK(n == 2 && refs[0].page == 3 && refs[1].page == 4);
    OK(kvg_verify_read(t, 2, pages, 2, 32));
    /* The same bytes but one shorter are another key. */
    VIOLATES(kvg_attach_prefix(t, 2, key, sizeof key - 1, NULL, 0, NULL), KVG_VIOLATION_KIND_UNKNOWN_PREFIX);
    /* Another tenant, until tenant 7 allows sharing. */
    VIOLATES(kvg_attach_prefix(t, 3, key, sizeof key, NULL, 0, NULL), KVG_VIOLATION_KIND_CROSS_TENANT_SHARE);
    {
        kvg_violation_info info = last_info();
        CHECK(info.owner == 1 && info.owner_tenant == 7 && info.tenant == 8 && (info.fields & KVG_FIELD_PREFIX));
        CHECK(info.operation == KVG_OPERATION_ATTACH);
    }
    OK(kvg_allow_cross_tenant_sharing(t, 7, 1));
    OK(kvg_attach_prefix(t, 3, key, sizeof key, NULL, 0, NULL));
    OK(kvg_allow_cross_tenant_sharing(t, 7, 0));
    OK(kvg_detach_prefix(t, 3, key, sizeof key, NULL));
    VIOLATES(kvg_evict_prefix(t, key, sizeof key, NULL), KVG_VIOLATION_KIND_EVICT_IN_USE);
    OK(kvg_detach_prefix(t, 1, key, sizeof key, NULL));
    OK(kvg_detach_prefix(t, 2, key, sizeof key, NULL));
    memset(&released, 0, sizeof released);
    released.struct_size = sizeof released;
    OK(kvg_evict_prefix(t, key, sizeof key, &released));
    CHECK(released.ended == 2);
    VIOLATES(kvg_evict_prefix(t, key, sizeof key, NULL), KVG_VIOLATION_KIND_UNKNOWN_PREFIX);
    /* Evicted keys can be published again. */
    OK(kvg_claim(t, 1, pages, 2, NULL, 0));
    OK(kvg_publish_prefix(t, 1, key, sizeof key, pages, 2));
    kvg_table_free(t);
}

/* Every violation kind the table raises, through the C calls. */
static void test_every_violation_kind(void) {
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    const int32_t p5[1] = {5}, p6[1] = {6}, p7[1] = {7}, p8[1] = {8}, p9[2] = {9, 10};
    const int32_t zero[1] = {0}, negative[1] = {-1}, beyond[1] = {PAGES};
    const uint8_t key[] = "prefix";

    VIOLATES(kvg_admit(t, 1, 1, MAX_CONTEXT, 1), KVG_VIOLATION_KIND_EXCEEDS_MAX_CONTEXT);
    OK(kvg_admit(t, 1, 1, 64, 0));
    OK(kvg_admit(t, 2, 2, 64, 0));
    VIOLATES(kvg_verify_read(t, 99, p5, 1, 1), KVG_VIOLATION_KIND_UNKNOWN_REQUEST);
    /* Refused mutations quarantine their request too (enforce): request 9 takes them. */
    OK(kvg_admit(t, 9, 9, 64, 0));
    OK(kvg_claim(t, 1, p5, 1, NULL, 0));
    VIOLATES(kvg_claim(t, 9, p5, 1, NULL, 0), KVG_VIOLATION_KIND_PAGE_NOT_FREE);
    VIOLATES(kvg_claim(t, 9, negative, 1, NULL, 0), KVG_VIOLATION_KIND_PAGE_OUT_OF_RANGE);
    VIOLATES(kvg_claim(t, 9, beyond, 1, NULL, 0), KVG_VIOLATION_KIND_PAGE_OUT_OF_RANGE);
    VIOLATES(kvg_claim(t, 9, zero, 1, NULL, 0), KVG_VIOLATION_KIND_RESERVED_PAGE);
    VIOLATES(kvg_record_write(t, 9, -3, 0, 1), KVG_VIOLATION_KIND_PAGE_OUT_OF_RANGE);
    OK(kvg_claim(t, 9, p8, 1, NULL, 0));
    VIOLATES(kvg_record_write(t, 9, 8, 0, PS + 1), KVG_VIOLATION_KIND_SLOT_OUT_OF_RANGE);
    {
        kvg_request_info req;
        req.struct_size = sizeof req;
        OK(kvg_get_request_info(t, 9, &req));
        CHECK(req.quarantined == 1);
    }
    OK(kvg_record_write(t, 1, 5, 0, 8));
    VIOLATES(kvg_verify_read(t, 1, p5, 1, 9), KVG_VIOLATION_KIND_UNWRITTEN_SLOTS);
    {
        kvg_violation_info info = last_info();
        CHECK(info.page == 5 && info.slot_start == 8 && info.slot_end == 9 && (info.fields & KVG_FIELD_SLOTS));
        CHECK(info.request == 1 && info.tenant == 1 && info.generation == 1 && info.block_index == 0);
        CHECK(info.operation == KVG_OPERATION_READ && strstr(info.message, "unwritten_slots") != NULL);
    }
    /* Request 1 is now quarantined (enforce): every later read is refused. */
    VIOLATES(kvg_verify_read(t, 1, p5, 1, 8), KVG_VIOLATION_KIND_QUARANTINED);
    VIOLATES(kvg_fork(t, 1, 3), KVG_VIOLATION_KIND_QUARANTINED);
    OK(kvg_release(t, 1, NULL));
    VIOLATES(kvg_release(t, 1, NULL), KVG_VIOLATION_KIND_DOUBLE_FREE);

    OK(kvg_admit(t, 1, 1, 64, 0));
    VIOLATES(kvg_admit(t, 1, 1, 64, 0), KVG_VIOLATION_KIND_DUPLICATE_REQUEST);
    OK(kvg_release(t, 1, NULL)); /* the duplicate quarantined it */
    OK(kvg_admit(t, 1, 1, 64, 0));
    OK(kvg_claim(t, 1, p6, 1, NULL, 0));
    OK(kvg_record_write(t, 1, 6, 0, PS));
    VIOLATES(kvg_verify_read(t, 2, p6, 1, PS), KVG_VIOLATION_KIND_FOREIGN_PAGE);
    {
        kvg_violation_info info = last_info();
        CHECK(info.owner == 1 && info.owner_tenant == 1 && info.request == 2 && info.tenant == 2);
    }
    OK(kvg_release(t, 2, NULL));
    OK(kvg_admit(t, 2, 2, 64, 0));
    VIOLATES(kvg_verify_read(t, 2, p7, 1, 1), KVG_VIOLATION_KIND_FREED_PAGE);
    OK(kvg_release(t, 2, NULL));
    OK(kvg_admit(t, 2, 2, 64, 0));
    VIOLATES(kvg_verify_read(t, 1, p6, 1, PS + 1), KVG_VIOLATION_KIND_BLOCK_TABLE_TOO_SHORT);
    {
        kvg_violation_info info = last_info();
        CHECK((info.fields & KVG_FIELD_AMOUNTS) && info.found == PS + 1 && info.limit == PS);
    }
    OK(kvg_release(t, 1, NULL));

    /* Stale: a ref to an incarnation that ended, the page the reader's own again. */
    OK(kvg_admit(t, 1, 1, 64, 0));
    {
        kvg_page_ref old[1];
        OK(kvg_claim(t, 1, p7, 1, old, 1));
        OK(kvg_release_pages(t, 1, p7, 1, NULL));
        OK(kvg_claim(t, 1, p7, 1, NULL, 0));
        OK(kvg_record_write(t, 1, 7, 0, PS));
        VIOLATES(kvg_check_read_refs(t, 1, old, 1, PS), KVG_VIOLATION_KIND_STALE_PAGE);
        kvg_violation_info info = last_info();
        CHECK(info.expected_generation == 1 && info.generation == 2);
    }
    VIOLATES(kvg_record_import(t, 1, p7, 1, 10, 12), KVG_VIOLATION_KIND_TOKEN_COUNT_MISMATCH);

    /* Prefix kinds. */
    OK(kvg_claim(t, 1, p9, 2, NULL, 0));
    OK(kvg_record_write_tokens(t, 1, p9, 2, 0, 32));
    OK(kvg_publish_prefix(t, 1, key, sizeof key, p9, 2));
    VIOLATES(kvg_publish_prefix(t, 1, key, sizeof key, p7, 1), KVG_VIOLATION_KIND_DUPLICATE_PREFIX);
    OK(kvg_release(t, 1, NULL)); /* the duplicate quarantined it; the prefix stays (it has a key) */
    OK(kvg_admit(t, 1, 1, 64, 0));
    OK(kvg_attach_prefix(t, 1, key, sizeof key, NULL, 0, NULL));
    VIOLATES(kvg_record_write(t, 1, 9, 0, 1), KVG_VIOLATION_KIND_WRITE_TO_SHARED);
    OK(kvg_release(t, 1, NULL));
    OK(kvg_admit(t, 1, 1, 64, 0));
    OK(kvg_attach_prefix(t, 1, key, sizeof key, NULL, 0, NULL));
    VIOLATES(kvg_release_pages(t, 1, p9, 1, NULL), KVG_VIOLATION_KIND_PAGE_SHARED);
    VIOLATES(kvg_detach_prefix(t, 2, key, sizeof key, NULL), KVG_VIOLATION_KIND_UNKNOWN_PREFIX);

    /* The counters and the log saw them all; draining hands them out oldest first. */
    {
        uint64_t total = 0, foreign = 0;
        kvg_violation_info info;
        uint32_t found = 0;
        size_t drained = 0;
        OK(kvg_violation_count(t, 0, &total));
        OK(kvg_violation_count(t, KVG_VIOLATION_KIND_FOREIGN_PAGE, &foreign));
        /* 22 refusals above; the stale one went through a pure check, which counts nothing. */
        CHECK(total == 21 && foreign == 1);
        EXPECT(kvg_violation_count(t, 999, &total), KVG_STATUS_INVALID_ARGUMENT);
        info.struct_size = sizeof info;
        OK(kvg_drain_violation(t, &info, &found));
        CHECK(found == 1 && info.kind == KVG_VIOLATION_KIND_EXCEEDS_MAX_CONTEXT);
        for (drained = 1; found; drained++) OK(kvg_drain_violation(t, &info, &found));
        CHECK(drained - 1 == total);
        info.struct_size = 8;
        EXPECT(kvg_drain_violation(t, &info, &found), KVG_STATUS_BAD_STRUCT_SIZE);
        EXPECT(kvg_drain_violation(t, NULL, &found), KVG_STATUS_NULL_POINTER);
    }
    kvg_table_free(t);
}

/* One call per step: a block-table matrix with a row stride, and a slot mapping. */
static void test_steps(void) {
    enum { ROWS = 4, STRIDE = 6, BLOCKS = 4 };
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    uint64_t ids[ROWS] = {1, 2, 3, 4};
    int32_t matrix[ROWS * STRIDE];
    int32_t lens[ROWS] = {40, 40, 40, 40};
    uint8_t refused[ROWS];
    kvg_page_ref refs[3];

    for (int i = 0; i < ROWS * STRIDE; i++) matrix[i] = -1; /* padding past each row's pages */
    for (int r = 0; r < ROWS; r++) {
        OK(kvg_admit(t, ids[r], ids[r], 40, 0));
        OK(kvg_allocate(t, ids[r], 3, refs, 3));
        for (int b = 0; b < 3; b++) matrix[r * STRIDE + b] = refs[b].page;
    }
    /* The step's writes as a slot mapping: 40 tokens per request, padding at the end. */
    {
        int64_t slots[ROWS * 40 + 3];
        int32_t starts[ROWS + 1];
        for (int r = 0; r < ROWS; r++) {
            starts[r] = r * 40;
            for (int k = 0; k < 40; k++) slots[r * 40 + k] = (int64_t)matrix[r * STRIDE + k / PS] * PS + k % PS;
        }
        starts[ROWS] = ROWS * 40;
        slots[ROWS * 40] = slots[ROWS * 40 + 1] = slots[ROWS * 40 + 2] = -1;
        /* Request 4 writes into request 3's page: refused alone, nothing of it recorded. */
        slots[3 * 40 + 5] = (int64_t)matrix[2 * STRIDE] * PS + 5;
        memset(refused, 0xff, sizeof refused);
        VIOLATES(kvg_record_step_writes(t, ROWS, ids, slots, ROWS * 40 + 3, starts, refused),
                 KVG_VIOLATION_KIND_FOREIGN_PAGE);
        CHECK(refused[0] == 0 && refused[1] == 0 && refused[2] == 0 && refused[3] == 1);
        CHECK(kvg_last_violation_count() == 1);
        {
            kvg_violation_info info = last_info();
            CHECK((info.fields & KVG_FIELD_ROW) && info.row == 3 && info.request == 4);
        }
        /* Malformed boundaries are refused before anything is recorded. */
        starts[2] = starts[1] - 1;
        EXPECT(kvg_record_step_writes(t, ROWS, ids, slots, ROWS * 40 + 3, starts, NULL), KVG_STATUS_INVALID_ARGUMENT);
        starts[2] = 2 * 40;
        starts[ROWS] = ROWS * 40 + 100;
        EXPECT(kvg_record_step_writes(t, ROWS, ids, slots, ROWS * 40 + 3, starts, NULL), KVG_STATUS_INVALID_ARGUMENT);
        starts[ROWS] = ROWS * 40;
        starts[0] = -1;
        EXPECT(kvg_record_step_writes(t, ROWS, ids, slots, ROWS * 40 + 3, starts, NULL), KVG_STATUS_INVALID_ARGUMENT);
        starts[0] = 0;
        /* Request 4 is quarantined now; release it and bring it back with its own writes. */
        OK(kvg_release(t, 4, NULL));
        OK(kvg_admit(t, 4, 4, 40, 0));
        OK(kvg_allocate(t, 4, 3, refs, 3));
        for (int b = 0; b < 3; b++) matrix[3 * STRIDE + b] = refs[b].page;
        OK(kvg_record_write_tokens(t, 4, &matrix[3 * STRIDE], 3, 0, 40));
    }
    memset(refused, 0xff, sizeof refused);
    OK(kvg_verify_step(t, ROWS, ids, matrix, STRIDE, BLOCKS, lens, refused));
    CHECK(refused[0] == 0 && refused[3] == 0);
    OK(kvg_check_step(t, ROWS, ids, matrix, STRIDE, BLOCKS, lens, NULL));

    /* The same step in FlashInfer's paged-KV (CSR) form: 3 pages a row, 8 tokens of the last. */
    {
        int32_t indptr[ROWS + 1], indices[ROWS * 3], last[ROWS];
        uint64_t before = 0, after = 0;
        for (int r = 0; r < ROWS; r++) {
            indptr[r] = r * 3;
            last[r] = 40 - 2 * PS;
            for (int b = 0; b < 3; b++) indices[r * 3 + b] = matrix[r * STRIDE + b];
        }
        indptr[ROWS] = ROWS * 3;
        memset(refused, 0xff, sizeof refused);
        OK(kvg_verify_step_csr(t, ROWS, ids, indptr, indices, last, refused));
        CHECK(refused[0] == 0 && refused[1] == 0 && refused[2] == 0 && refused[3] == 0);
        /* Sequence 1 reads sequence 0's first page: refused alone, and the pure form counts nothing. */
        indices[1 * 3 + 1] = matrix[0];
        OK(kvg_violation_count(t, 0, &before));
        EXPECT(kvg_check_step_csr(t, ROWS, ids, indptr, indices, last, refused), KVG_STATUS_VIOLATION);
        CHECK(refused[0] == 0 && refused[1] == 1 && refused[2] == 0 && refused[3] == 0);
        CHECK(kvg_last_violation_count() == 1 && last_kind(0) == KVG_VIOLATION_KIND_FOREIGN_PAGE);
        OK(kvg_violation_count(t, 0, &after));
        CHECK(after == before);
        indices[1 * 3 + 1] = matrix[1 * STRIDE + 1];
        /* A last page read past the page size reads past the sequence's pages. */
        last[2] = PS + 1;
        EXPECT(kvg_check_step_csr(t, ROWS, ids, indptr, indices, last, refused), KVG_STATUS_VIOLATION);
        CHECK(refused[2] == 1 && last_kind(0) == KVG_VIOLATION_KIND_BLOCK_TABLE_TOO_SHORT);
        last[2] = 40 - 2 * PS;
        /* Malformed: decreasing offsets, a negative first offset, a negative count. */
        indptr[2] = indptr[1] - 1;
        EXPECT(kvg_check_step_csr(t, ROWS, ids, indptr, indices, last, NULL), KVG_STATUS_INVALID_ARGUMENT);
        CHECK(strstr(kvg_last_error_message(), "kv_indptr[1..=2]") != NULL);
        indptr[2] = 2 * 3;
        indptr[0] = -1;
        EXPECT(kvg_check_step_csr(t, ROWS, ids, indptr, indices, last, NULL), KVG_STATUS_INVALID_ARGUMENT);
        indptr[0] = 0;
        last[3] = -1;
        EXPECT(kvg_verify_step_csr(t, ROWS, ids, indptr, indices, last, NULL), KVG_STATUS_INVALID_ARGUMENT);
        last[3] = 40 - 2 * PS;
        /* A sequence with no pages reads nothing; no sequences at all is a clean step. */
        indptr[1] = 0;
        OK(kvg_check_step_csr(t, 1, ids, indptr, indices, last, NULL));
        indptr[1] = 3;
        OK(kvg_verify_step_csr(t, 0, NULL, indptr, NULL, NULL, NULL));
        OK(kvg_verify_step_csr(t, ROWS, ids, indptr, indices, last, NULL));
    }

    /* Row 1 points at row 0's page, row 2 at a negative page (never wrapped onto a real one). */
    {
        int32_t saved1 = matrix[1 * STRIDE + 1], saved2 = matrix[2 * STRIDE];
        uint64_t before = 0, after = 0;
        matrix[1 * STRIDE + 1] = matrix[0];
        matrix[2 * STRIDE] = -2;
        OK(kvg_violation_count(t, 0, &before));
        EXPECT(kvg_check_step(t, ROWS, ids, matrix, STRIDE, BLOCKS, lens, refused), KVG_STATUS_VIOLATION);
        OK(kvg_violation_count(t, 0, &after));
        CHECK(after == before); /* pure */
        EXPECT(kvg_verify_step(t, ROWS, ids, matrix, STRIDE, BLOCKS, lens, refused), KVG_STATUS_VIOLATION);
        CHECK(refused[0] == 0 && refused[1] == 1 && refused[2] == 1 && refused[3] == 0);
        CHECK(kvg_last_violation_count() == 2);
        CHECK(strstr(kvg_last_error_message(), "2 of 4 rows refused") != NULL);
        CHECK(last_kind(0) == KVG_VIOLATION_KIND_FOREIGN_PAGE && last_kind(1) == KVG_VIOLATION_KIND_PAGE_OUT_OF_RANGE);
        {
            kvg_violation_info info;
            info.struct_size = sizeof info;
            OK(kvg_last_violation(1, &info));
            CHECK(info.row == 2 && info.block_index == 0 && info.page == (uint32_t)-2);
            /* Reading a violation leaves the thread's last error as it was. */
            CHECK(kvg_last_violation_count() == 2 && kvg_last_status() == KVG_STATUS_VIOLATION);
            info.struct_size = 4;
            EXPECT(kvg_last_violation(0, &info), KVG_STATUS_BAD_STRUCT_SIZE);
        }
        EXPECT(kvg_last_violation(2, NULL), KVG_STATUS_INVALID_ARGUMENT);
        OK(kvg_violation_count(t, 0, &after));
        CHECK(after == before + 2);
        matrix[1 * STRIDE + 1] = saved1;
        matrix[2 * STRIDE] = saved2;
    }
    /* Bad shapes: a stride below the row length, a negative token count. */
    EXPECT(kvg_verify_step(t, ROWS, ids, matrix, 2, BLOCKS, lens, NULL), KVG_STATUS_INVALID_ARGUMENT);
    lens[2] = -1;
    EXPECT(kvg_verify_step(t, ROWS, ids, matrix, STRIDE, BLOCKS, lens, NULL), KVG_STATUS_INVALID_ARGUMENT);
    lens[2] = 40;
    /* More tokens than the row's blocks: block_table_too_short. */
    lens[0] = BLOCKS * PS + 1;
    EXPECT(kvg_check_step(t, ROWS, ids, matrix, STRIDE, BLOCKS, lens, refused), KVG_STATUS_VIOLATION);
    CHECK(last_kind(0) == KVG_VIOLATION_KIND_BLOCK_TABLE_TOO_SHORT && refused[0] == 1);
    kvg_table_free(t);
}

/* A step's claims in one call: each sequence all or nothing, a refused one alone. */
/* kvg_verify_rows: the engine's block table read in place across steps through a row cache;
   unchanged rows judged from their last page, the verdict kvg_verify_step's. */
static void test_rows(void) {
    enum { ROWS = 4, W = 6, READS = 3 };
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    kvg_row_cache *cache = NULL;
    uint64_t ids[READS] = {1, 2, 3}, incremental = 99, full = 99;
    uint32_t rows[READS] = {0, 1, 2};
    int32_t matrix[ROWS * W];
    int32_t lens[READS] = {40, 40, 40};
    uint8_t refused[READS];
    kvg_page_ref refs[3];

    for (int i = 0; i < ROWS * W; i++) matrix[i] = -1;
    for (int r = 0; r < READS; r++) {
        OK(kvg_admit(t, ids[r], ids[r], 48, 0));
        OK(kvg_allocate(t, ids[r], 3, refs, 3));
        for (int b = 0; b < 3; b++) matrix[r * W + b] = refs[b].page;
        OK(kvg_record_write_tokens(t, ids[r], &matrix[r * W], 3, 0, 40));
    }
    EXPECT(kvg_row_cache_new(NULL), KVG_STATUS_NULL_POINTER);
    OK(kvg_row_cache_new(&cache));
    CHECK(cache != NULL);
    OK(kvg_verify_rows(t, cache, matrix, ROWS, W, READS, ids, rows, lens, refused));
    OK(kvg_row_cache_counts(cache, &incremental, &full));
    CHECK(incremental == 0 && full == 3);
    /* Each request writes its 41st token and reads it: every row from its last page. */
    for (int r = 0; r < READS; r++) {
        OK(kvg_record_write_tokens(t, ids[r], &matrix[r * W], 3, 40, 41));
        lens[r] = 41;
    }
    OK(kvg_check_rows(t, cache, matrix, ROWS, W, READS, ids, rows, lens, NULL));
    OK(kvg_row_cache_counts(cache, &incremental, NULL));
    CHECK(incremental == 3);
    /* Row 1 changed behind kvguard's back (request 3's page in it): refused, judged, alone. */
    matrix[1 * W] = matrix[2 * W];
    memset(refused, 0xff, sizeof refused);
    VIOLATES(kvg_verify_rows(t, cache, matrix, ROWS, W, READS, ids, rows, lens, refused),
             KVG_VIOLATION_KIND_FOREIGN_PAGE);
    CHECK(refused[0] == 0 && refused[1] == 1 && refused[2] == 0);
    {
        kvg_violation_info info = last_info();
        CHECK((info.fields & KVG_FIELD_ROW) && info.row == 1 && info.request == 2);
    }
    /* A row past the table, a negative count, rows that are not whole: refused, nothing checked. */
    rows[2] = ROWS;
    EXPECT(kvg_verify_rows(t, cache, matrix, ROWS, W, READS, ids, rows, lens, NULL), KVG_STATUS_INVALID_ARGUMENT);
    rows[2] = 2;
    lens[0] = -1;
    EXPECT(kvg_verify_rows(t, cache, matrix, ROWS, W, READS, ids, rows, lens, NULL), KVG_STATUS_INVALID_ARGUMENT);
    lens[0] = 41;
    EXPECT(kvg_verify_rows(t, cache, NULL, ROWS, W, READS, ids, rows, lens, NULL), KVG_STATUS_NULL_POINTER);
    OK(kvg_verify_rows(t, cache, matrix, 0, W, 0, NULL, NULL, NULL, NULL));
    /* Handles: NULL, a table given as a cache, a cache given as a table, a cache freed twice. */
    EXPECT(kvg_verify_rows(t, NULL, matrix, ROWS, W, READS, ids, rows, lens, NULL), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_verify_rows(t, (kvg_row_cache *)t, matrix, ROWS, W, READS, ids, rows, lens, NULL),
           KVG_STATUS_INVALID_HANDLE);
    EXPECT(kvg_verify_rows((kvg_table *)cache, cache, matrix, ROWS, W, READS, ids, rows, lens, NULL),
           KVG_STATUS_INVALID_HANDLE);
    EXPECT(kvg_row_cache_counts(NULL, &incremental, &full), KVG_STATUS_NULL_POINTER);
    OK(kvg_row_cache_free(NULL));
    OK(kvg_row_cache_free(cache));
    EXPECT(kvg_row_cache_free(cache), KVG_STATUS_INVALID_HANDLE);
    EXPECT(kvg_row_cache_counts(cache, &incremental, &full), KVG_STATUS_INVALID_HANDLE);
    kvg_table_free(t);
}

/* kvg_decode_forward / kvg_verify_slot_rows: SGLang's req_to_token (one slot per token); a decode
   forward's writes recorded and each row's window checked in one call; the full check after. */
static void test_write_decode_rows(void) {
    enum { ROWS = 3, ENTRIES = PAGES + 1, N = 4 };
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    int64_t keys[ROWS] = {1, 2, 3}, claimants[ROWS] = {1, 1, 0}, checked[ROWS] = {40, 40, 40};
    int64_t owner[ENTRIES] = {0}, prefix[ENTRIES] = {0};
    uint32_t rows[N] = {0, 1, 2, 0};
    int64_t cols[N] = {32, 20, 5, 33}, slots[N];
    kvg_row_write outcome[N];
    size_t left = 99;
    kvg_page_ref ref;
    int32_t taken = 9;
    uint64_t counted = 99;

    for (int r = 0; r < ROWS; r++) OK(kvg_admit(t, (uint64_t)keys[r], (uint64_t)keys[r], 48, 8));
    OK(kvg_claim(t, 1, &taken, 1, &ref, 1)); /* request 1 holds page 9; the mirror does not know */
    /* Row 0 (request 1) writes into page 5, new; row 1 (request 2) into page 9, request 1's: its
       claim is refused; row 2 claims nothing (no live request): left; row 0 again in page 5. */
    slots[0] = 5 * PS;
    slots[1] = 9 * PS + 1;
    slots[2] = 7 * PS;
    slots[3] = 5 * PS + 1;
    VIOLATES(kvg_write_decode_rows(t, keys, claimants, checked, ROWS, owner, prefix, ENTRIES, N, rows, cols, N, slots,
                                   outcome, &left),
             KVG_VIOLATION_KIND_PAGE_NOT_FREE);
    CHECK(outcome[0] == KVG_ROW_WRITE_CLAIMED && outcome[1] == KVG_ROW_WRITE_REFUSED);
    CHECK(outcome[2] == KVG_ROW_WRITE_LEFT && outcome[3] == KVG_ROW_WRITE_OWNED && left == 1);
    CHECK(owner[5] == 1 && owner[9] == 0 && owner[7] == 0);           /* the grant, and only it */
    CHECK(checked[0] == 32 && checked[1] == 20 && checked[2] == 5);   /* each row's lowest column */
    CHECK(kvg_violation_count(t, KVG_VIOLATION_KIND_PAGE_NOT_FREE, &counted) == KVG_STATUS_OK && counted == 1);
    /* The next step: row 0 in page 5 again (its own now), one column for all: nothing new. */
    slots[0] = 5 * PS + 2;
    int64_t col = 34;
    OK(kvg_write_decode_rows(t, keys, claimants, checked, ROWS, owner, prefix, ENTRIES, 1, rows, &col, 1, slots,
                             outcome, &left));
    CHECK(outcome[0] == KVG_ROW_WRITE_OWNED && left == 0 && checked[0] == 32);
    /* Malformed, nothing changed: page arrays one short, a row past the mirror, cols of two for
       four positions, page_owner overlapping row_checked, a NULL outcome or left. */
    EXPECT(kvg_write_decode_rows(t, keys, claimants, checked, ROWS, owner, prefix, ENTRIES - 1, 1, rows, &col, 1,
                                 slots, outcome, &left),
           KVG_STATUS_INVALID_ARGUMENT);
    rows[1] = ROWS;
    EXPECT(kvg_write_decode_rows(t, keys, claimants, checked, ROWS, owner, prefix, ENTRIES, N, rows, cols, N, slots,
                                 outcome, &left),
           KVG_STATUS_INVALID_ARGUMENT);
    rows[1] = 1;
    EXPECT(kvg_write_decode_rows(t, keys, claimants, checked, ROWS, owner, prefix, ENTRIES, N, rows, cols, 2, slots,
                                 outcome, &left),
           KVG_STATUS_INVALID_ARGUMENT);
    EXPECT(kvg_write_decode_rows(t, keys, claimants, owner + 1, ROWS, owner, prefix, ENTRIES, 1, rows, &col, 1, slots,
                                 outcome, &left),
           KVG_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(kvg_last_error_message(), "shares memory") != NULL);
    EXPECT(kvg_write_decode_rows(t, keys, claimants, checked, ROWS, owner, prefix, ENTRIES, 1, rows, &col, 1, slots,
                                 outcome, (size_t *)(void *)(owner + 6)),
           KVG_STATUS_INVALID_ARGUMENT);
    EXPECT(kvg_write_decode_rows(t, keys, claimants, checked, ROWS, owner, prefix, ENTRIES, 1, rows, &col, 1, slots,
                                 NULL, &left),
           KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_write_decode_rows(t, keys, claimants, checked, ROWS, owner, prefix, ENTRIES, 1, rows, &col, 1, slots,
                                 outcome, NULL),
           KVG_STATUS_NULL_POINTER);
    CHECK(owner[5] == 1 && owner[6] == 0 && checked[0] == 32 && checked[1] == 20);
    kvg_table_free(t);
}

static void test_slot_rows(void) {
    enum { READS = 2, W = 3 * PS };
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    uint64_t ids[READS] = {1, 2};
    uint32_t rows[READS] = {0, 1};
    int32_t matrix[READS * W], from[READS] = {40, 40}, lens[READS] = {41, 41};
    int64_t slots[READS];
    uint8_t refused[READS];
    kvg_decode_stage stage = 99;
    kvg_page_ref refs[3];
    uint64_t counted = 99;

    for (int r = 0; r < READS; r++) {
        int32_t pages[3];
        OK(kvg_admit(t, ids[r], ids[r], 48, 0));
        OK(kvg_allocate(t, ids[r], 3, refs, 3));
        for (int b = 0; b < 3; b++) pages[b] = refs[b].page;
        for (int k = 0; k < W; k++) matrix[r * W + k] = pages[k / PS] * PS + k % PS;
        OK(kvg_record_write_tokens(t, ids[r], pages, 3, 0, 40));
        slots[r] = matrix[r * W + 40];
    }
    /* The whole rows, then each row's 41st token written and its window read in one call. */
    OK(kvg_verify_slot_rows(t, matrix, READS, W, READS, ids, rows, NULL, from, NULL));
    OK(kvg_decode_forward(t, matrix, READS, W, READS, ids, rows, from, lens, slots, refused, &stage));
    CHECK(stage == KVG_DECODE_STAGE_CLEAN && refused[0] == 0 && refused[1] == 0);
    /* Row 1's 42nd entry names request 1's slot: its window is refused (pure), the writes stand. */
    for (int r = 0; r < READS; r++) {
        from[r] = 41;
        lens[r] = 42;
        slots[r] = matrix[r * W + 41];
    }
    matrix[1 * W + 41] = matrix[0 * W + 41];
    slots[1] = matrix[1 * W + 40] + 1; /* its own next slot, as its engine wrote it */
    EXPECT(kvg_decode_forward(t, matrix, READS, W, READS, ids, rows, from, lens, slots, refused, &stage),
           KVG_STATUS_VIOLATION);
    CHECK(stage == KVG_DECODE_STAGE_WINDOW && refused[0] == 0 && refused[1] == 1);
    CHECK(last_kind(0) == KVG_VIOLATION_KIND_FOREIGN_PAGE);
    OK(kvg_violation_count(t, KVG_VIOLATION_KIND_FOREIGN_PAGE, &counted));
    CHECK(counted == 0); /* pure: nothing counted */
    /* The full check judges it: refused, counted. */
    VIOLATES(kvg_verify_slot_rows(t, matrix, READS, W, READS, ids, rows, NULL, lens, refused),
             KVG_VIOLATION_KIND_FOREIGN_PAGE);
    CHECK(refused[0] == 0 && refused[1] == 1);
    OK(kvg_violation_count(t, KVG_VIOLATION_KIND_FOREIGN_PAGE, &counted));
    CHECK(counted == 1);
    /* A write into another request's page is refused at the writes, judged; nothing read. */
    slots[0] = matrix[1 * W];
    EXPECT(kvg_decode_forward(t, matrix, READS, W, READS, ids, rows, from, lens, slots, refused, &stage),
           KVG_STATUS_VIOLATION);
    CHECK(stage == KVG_DECODE_STAGE_WRITES && refused[0] == 1);
    /* Malformed: a NULL stage, a row past the table, a negative count, a NULL table array. */
    EXPECT(kvg_decode_forward(t, matrix, READS, W, READS, ids, rows, from, lens, slots, refused, NULL),
           KVG_STATUS_NULL_POINTER);
    rows[1] = READS;
    EXPECT(kvg_decode_forward(t, matrix, READS, W, READS, ids, rows, from, lens, slots, refused, &stage),
           KVG_STATUS_INVALID_ARGUMENT);
    rows[1] = 1;
    lens[0] = -1;
    EXPECT(kvg_check_slot_rows(t, matrix, READS, W, READS, ids, rows, from, lens, NULL), KVG_STATUS_INVALID_ARGUMENT);
    lens[0] = 42;
    EXPECT(kvg_check_slot_rows(t, NULL, READS, W, READS, ids, rows, from, lens, NULL), KVG_STATUS_NULL_POINTER);
    OK(kvg_decode_forward(t, matrix, 0, W, 0, NULL, NULL, NULL, NULL, NULL, NULL, &stage));
    CHECK(stage == KVG_DECODE_STAGE_CLEAN);
    kvg_table_free(t);
}

/* kvg_verify_slot_rows_cached: whole rows of a token-slot table across checks through a slot-row
   cache; unchanged rows judged from their last page, the verdict kvg_verify_slot_rows's. */
static void test_slot_rows_cached(void) {
    enum { READS = 2, W = 3 * PS };
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    kvg_slot_row_cache *cache = NULL;
    uint64_t ids[READS] = {1, 2}, incremental = 99, full = 99;
    uint32_t rows[READS] = {0, 1};
    int32_t matrix[READS * W], lens[READS] = {40, 40};
    uint8_t refused[READS];
    kvg_page_ref refs[3];

    for (int r = 0; r < READS; r++) {
        int32_t pages[3];
        OK(kvg_admit(t, ids[r], ids[r], 48, 0));
        OK(kvg_allocate(t, ids[r], 3, refs, 3));
        for (int b = 0; b < 3; b++) pages[b] = refs[b].page;
        for (int k = 0; k < W; k++) matrix[r * W + k] = pages[k / PS] * PS + k % PS;
        OK(kvg_record_write_tokens(t, ids[r], pages, 3, 0, 44));
    }
    EXPECT(kvg_slot_row_cache_new(NULL), KVG_STATUS_NULL_POINTER);
    OK(kvg_slot_row_cache_new(&cache));
    CHECK(cache != NULL);
    OK(kvg_verify_slot_rows_cached(t, cache, matrix, READS, W, READS, ids, rows, lens, refused));
    OK(kvg_slot_row_cache_counts(cache, &incremental, &full));
    CHECK(incremental == 0 && full == 2);
    /* Four tokens later: each row from its last clean page. */
    lens[0] = lens[1] = 44;
    OK(kvg_check_slot_rows_cached(t, cache, matrix, READS, W, READS, ids, rows, lens, NULL));
    OK(kvg_slot_row_cache_counts(cache, &incremental, NULL));
    CHECK(incremental == 2);
    /* Row 1's first entry changed behind kvguard's back (request 1's slot): refused, judged, alone. */
    matrix[1 * W] = matrix[0];
    memset(refused, 0xff, sizeof refused);
    VIOLATES(kvg_verify_slot_rows_cached(t, cache, matrix, READS, W, READS, ids, rows, lens, refused),
             KVG_VIOLATION_KIND_FOREIGN_PAGE);
    CHECK(refused[0] == 0 && refused[1] == 1);
    /* Malformed: a row past the table, a negative count; handles NULL, foreign, freed. */
    rows[1] = READS;
    EXPECT(kvg_verify_slot_rows_cached(t, cache, matrix, READS, W, READS, ids, rows, lens, NULL),
           KVG_STATUS_INVALID_ARGUMENT);
    rows[1] = 1;
    lens[0] = -1;
    EXPECT(kvg_verify_slot_rows_cached(t, cache, matrix, READS, W, READS, ids, rows, lens, NULL),
           KVG_STATUS_INVALID_ARGUMENT);
    lens[0] = 44;
    EXPECT(kvg_verify_slot_rows_cached(t, NULL, matrix, READS, W, READS, ids, rows, lens, NULL),
           KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_verify_slot_rows_cached(t, (kvg_slot_row_cache *)t, matrix, READS, W, READS, ids, rows, lens, NULL),
           KVG_STATUS_INVALID_HANDLE);
    OK(kvg_slot_row_cache_free(cache));
    EXPECT(kvg_slot_row_cache_free(cache), KVG_STATUS_INVALID_HANDLE);
    EXPECT(kvg_verify_slot_rows_cached(t, cache, matrix, READS, W, READS, ids, rows, lens, NULL),
           KVG_STATUS_INVALID_HANDLE);
    OK(kvg_slot_row_cache_free(NULL));
    kvg_table_free(t);
}

/* kvg_held_rows: a block table kvguard holds, changed through its calls and read through one
   pointer; each step judged from what changed, a change below a row's checked pages in full. */
static void test_held_rows(void) {
    enum { READS = 2, W = 4 };
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    kvg_held_rows *held = NULL;
    uint64_t ids[READS] = {1, 2}, incremental = 99, full = 99;
    uint32_t rows[READS] = {0, 2};
    int32_t pages[READS][3], lens[READS] = {10, 10};
    const int32_t *entries = NULL;
    size_t nrows = 0, width = 0, len = 99;
    uint8_t refused[READS];
    kvg_page_ref refs[3];

    EXPECT(kvg_held_rows_new(3, W, NULL), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_held_rows_new(SIZE_MAX / 2, W, &held), KVG_STATUS_INVALID_ARGUMENT);
    CHECK(held == NULL);
    OK(kvg_held_rows_new(3, W, &held));
    CHECK(held != NULL);
    for (int r = 0; r < READS; r++) {
        OK(kvg_admit(t, ids[r], ids[r], 12, 0));
        OK(kvg_allocate(t, ids[r], 3, refs, 3));
        for (int b = 0; b < 3; b++) pages[r][b] = refs[b].page;
        OK(kvg_record_write_tokens(t, ids[r], pages[r], 3, 0, 11));
        OK(kvg_held_rows_append(held, rows[r], pages[r], 2));
        OK(kvg_held_rows_append(held, rows[r], pages[r] + 2, 1));
    }
    OK(kvg_held_rows_entries(held, &entries, &nrows, &width));
    CHECK(nrows == 3 && width == W);
    CHECK(entries[0] == pages[0][0] && entries[2] == pages[0][2] && entries[3] == -1 && entries[W] == -1);
    CHECK(entries[2 * W + 1] == pages[1][1]);
    OK(kvg_held_rows_len(held, 2, &len));
    CHECK(len == 3);
    OK(kvg_verify_held_rows(t, held, READS, ids, rows, lens, refused));
    lens[0] = lens[1] = 11;
    OK(kvg_check_held_rows(t, held, READS, ids, rows, lens, NULL));
    OK(kvg_held_rows_counts(held, &incremental, &full));
    CHECK(incremental == 2 && full == 2);
    /* Rows swapped and swapped back, a row copied over the spare row and read there. */
    OK(kvg_held_rows_swap_rows(held, 0, 2));
    CHECK(entries[0] == pages[1][0]);
    OK(kvg_held_rows_swap_rows(held, 2, 0));
    OK(kvg_held_rows_copy_row(held, 0, 1));
    rows[0] = 1;
    OK(kvg_verify_held_rows(t, held, READS, ids, rows, lens, refused));
    OK(kvg_held_rows_counts(held, &incremental, NULL));
    CHECK(incremental == 4);
    /* Request 2's first entry set to request 1's page: refused, judged, alone. */
    int32_t wrong[3] = {pages[0][0], pages[1][1], pages[1][2]};
    OK(kvg_held_rows_set_row(held, 2, wrong, 3));
    memset(refused, 0xff, sizeof refused);
    VIOLATES(kvg_verify_held_rows(t, held, READS, ids, rows, lens, refused), KVG_VIOLATION_KIND_FOREIGN_PAGE);
    CHECK(refused[0] == 0 && refused[1] == 1);
    OK(kvg_held_rows_truncate(held, 2, 0));
    OK(kvg_held_rows_len(held, 2, &len));
    CHECK(len == 0 && entries[2 * W] == -1);
    /* Malformed: too long a row, rows past the table, a negative count, NULL entries;
       handles NULL, foreign, freed. Nothing changed by a refused change. */
    int32_t five[5] = {1, 2, 3, 4, 5};
    EXPECT(kvg_held_rows_append(held, 1, five, 5), KVG_STATUS_INVALID_ARGUMENT);
    EXPECT(kvg_held_rows_set_row(held, 1, five, 5), KVG_STATUS_INVALID_ARGUMENT);
    EXPECT(kvg_held_rows_append(held, 3, five, 1), KVG_STATUS_INVALID_ARGUMENT);
    EXPECT(kvg_held_rows_copy_row(held, 0, 3), KVG_STATUS_INVALID_ARGUMENT);
    EXPECT(kvg_held_rows_swap_rows(held, 3, 0), KVG_STATUS_INVALID_ARGUMENT);
    EXPECT(kvg_held_rows_truncate(held, 3, 0), KVG_STATUS_INVALID_ARGUMENT);
    EXPECT(kvg_held_rows_len(held, 3, &len), KVG_STATUS_INVALID_ARGUMENT);
    EXPECT(kvg_held_rows_len(held, 0, NULL), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_held_rows_append(held, 1, NULL, 1), KVG_STATUS_NULL_POINTER);
    OK(kvg_held_rows_append(held, 1, NULL, 0));
    CHECK(entries[W + 3] == -1 && entries[W] == pages[0][0]);
    rows[1] = 3;
    EXPECT(kvg_verify_held_rows(t, held, READS, ids, rows, lens, NULL), KVG_STATUS_INVALID_ARGUMENT);
    rows[1] = 2;
    lens[0] = -1;
    EXPECT(kvg_verify_held_rows(t, held, READS, ids, rows, lens, NULL), KVG_STATUS_INVALID_ARGUMENT);
    lens[0] = 11;
    EXPECT(kvg_verify_held_rows(t, NULL, READS, ids, rows, lens, NULL), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_verify_held_rows(t, (kvg_held_rows *)t, READS, ids, rows, lens, NULL), KVG_STATUS_INVALID_HANDLE);
    OK(kvg_held_rows_free(held));
    EXPECT(kvg_held_rows_free(held), KVG_STATUS_INVALID_HANDLE);
    EXPECT(kvg_held_rows_append(held, 1, five, 1), KVG_STATUS_INVALID_HANDLE);
    OK(kvg_held_rows_free(NULL));
    kvg_table_free(t);
}

/* kvg_engine_step: a step's early events, its writes from the rows, its late events and its
   reads in one call, as the calls it stands for judge them; kvg_apply_events alone. */
static void test_engine_step(void) {
    enum { N = 2, W = 4 };
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    kvg_row_cache *cache = NULL;
    uint64_t ids[N] = {11, 12}, computed[N] = {0, 0}, scheduled[N] = {20, 20};
    uint8_t kinds[4] = {KVG_EVENT_KIND_ADMIT, KVG_EVENT_KIND_ADMIT, KVG_EVENT_KIND_CLAIM, KVG_EVENT_KIND_CLAIM};
    uint64_t reqs[4] = {11, 12, 11, 12}, keys[4] = {1, 2, 0, 0};
    uint64_t args[8] = {20, 8, 20, 8, 0, 2, 2, 4};
    int32_t pages[4] = {3, 4, 5, 6};
    int32_t matrix[N * W] = {3, 4, -1, -1, 5, 6, -1, -1};
    uint8_t r_early[4], r_writes[N], r_late[1], r_reads[N];
    uint64_t incremental = 0, full = 0;
    kvg_step_input step;

    OK(kvg_row_cache_new(&cache));
    memset(&step, 0, sizeof step);
    step.struct_size = sizeof step;
    step.early = (kvg_events){4, kinds, reqs, keys, args, pages, 4};
    step.requests = N;
    step.request_ids = ids;
    step.block_table = matrix;
    step.table_rows = N;
    step.width = W;
    step.num_computed_tokens = computed;
    step.num_scheduled_tokens = scheduled;
    step.refused_early = r_early;
    step.refused_writes = r_writes;
    step.refused_late = r_late;
    step.refused_reads = r_reads;
    memset(r_early, 0xff, sizeof r_early);
    OK(kvg_engine_step(t, cache, &step));
    CHECK(r_early[0] == 0 && r_early[3] == 0 && r_reads[0] == 0 && r_reads[1] == 0);
    /* A decode token each; request 12's row now names 11's page: its read is refused, alone. */
    step.early.len = 0;
    computed[0] = computed[1] = 20;
    scheduled[0] = scheduled[1] = 1;
    matrix[W + 1] = 4;
    VIOLATES(kvg_engine_step(t, cache, &step), KVG_VIOLATION_KIND_FOREIGN_PAGE);
    CHECK(r_reads[0] == 0 && r_reads[1] == 1 && r_writes[0] == 0 && r_writes[1] == 1);
    {
        kvg_violation_info info = last_info();
        CHECK((info.fields & KVG_FIELD_ROW) && info.row == 1 && info.request == 12);
    }
    matrix[W + 1] = 6;
    /* Request 11 decodes again: its row judged from its last page. */
    step.requests = 1;
    computed[0] = 21;
    OK(kvg_engine_step(t, cache, &step));
    OK(kvg_row_cache_counts(cache, &incremental, &full));
    CHECK(incremental >= 2 && full >= 2);
    /* Wrong shapes apply nothing: an unknown kind, a prefix event, pages out of range, too many
       tokens for a row, a bad struct_size. Request 13's admission is never applied. */
    {
        uint8_t k[1] = {KVG_EVENT_KIND_ADMIT};
        uint64_t rq[1] = {13}, ky[1] = {1}, ag[2] = {4, 4};
        kvg_request_info info;
        step.early = (kvg_events){1, k, rq, ky, ag, NULL, 0};
        k[0] = 0;
        EXPECT(kvg_engine_step(t, cache, &step), KVG_STATUS_INVALID_ARGUMENT);
        k[0] = KVG_EVENT_KIND_PUBLISH;
        EXPECT(kvg_engine_step(t, cache, &step), KVG_STATUS_INVALID_ARGUMENT);
        k[0] = KVG_EVENT_KIND_CLAIM;
        EXPECT(kvg_engine_step(t, cache, &step), KVG_STATUS_INVALID_ARGUMENT); /* pages 4..4 of 0 */
        k[0] = KVG_EVENT_KIND_ADMIT;
        scheduled[0] = W * PS + 1;
        EXPECT(kvg_engine_step(t, cache, &step), KVG_STATUS_INVALID_ARGUMENT);
        scheduled[0] = 1;
        step.struct_size = 8;
        EXPECT(kvg_engine_step(t, cache, &step), KVG_STATUS_BAD_STRUCT_SIZE);
        step.struct_size = sizeof step;
        EXPECT(kvg_engine_step(t, NULL, &step), KVG_STATUS_NULL_POINTER);
        EXPECT(kvg_engine_step(t, cache, NULL), KVG_STATUS_NULL_POINTER);
        memset(&info, 0, sizeof info);
        info.struct_size = sizeof info;
        EXPECT(kvg_get_request_info(t, 13, &info), KVG_STATUS_INVALID_ARGUMENT);
    }
    /* kvg_apply_events: 13 and 14 admitted, then both claim page 7: the second refused alone. */
    {
        uint8_t k[4] = {KVG_EVENT_KIND_ADMIT, KVG_EVENT_KIND_ADMIT, KVG_EVENT_KIND_CLAIM, KVG_EVENT_KIND_CLAIM};
        uint64_t rq[4] = {13, 14, 13, 14}, ky[4] = {1, 1, 0, 0}, ag[8] = {4, 4, 4, 4, 0, 1, 0, 1};
        int32_t pg[1] = {7};
        uint8_t refused[4];
        kvg_events ev = {4, k, rq, ky, ag, pg, 1};
        VIOLATES(kvg_apply_events(t, &ev, refused), KVG_VIOLATION_KIND_PAGE_NOT_FREE);
        CHECK(refused[0] == 0 && refused[1] == 0 && refused[2] == 0 && refused[3] == 1);
        CHECK(last_info().row == 3);
        EXPECT(kvg_apply_events(t, NULL, refused), KVG_STATUS_NULL_POINTER);
        ev.kinds = NULL;
        EXPECT(kvg_apply_events(t, &ev, refused), KVG_STATUS_NULL_POINTER);
    }
    OK(kvg_row_cache_free(cache));
    kvg_table_free(t);
}

static void test_claim_step(void) {
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    uint64_t ids[3] = {1, 2, 3};
    /* 1 takes pages 3 and 4; 2 takes 5 and 4 (1 just took 4); 3 takes 6. */
    int32_t pages[5] = {3, 4, 5, 4, 6};
    int32_t indptr[4] = {0, 2, 4, 5};
    uint8_t refused[3];
    kvg_page_info page;
    for (int i = 0; i < 3; i++) OK(kvg_admit(t, ids[i], ids[i], 40, 0));
    /* Malformed offsets are refused before anything is claimed. */
    indptr[2] = 1;
    EXPECT(kvg_claim_step(t, 3, ids, pages, indptr, refused), KVG_STATUS_INVALID_ARGUMENT);
    CHECK(strstr(kvg_last_error_message(), "indptr[1..=2]") != NULL);
    indptr[2] = 4;
    page.struct_size = sizeof page;
    OK(kvg_get_page_info(t, 3, &page));
    CHECK(page.state == KVG_PAGE_STATE_FREE);
    memset(refused, 0xff, sizeof refused);
    VIOLATES(kvg_claim_step(t, 3, ids, pages, indptr, refused), KVG_VIOLATION_KIND_PAGE_NOT_FREE);
    CHECK(refused[0] == 0 && refused[1] == 1 && refused[2] == 0);
    {
        kvg_violation_info info = last_info();
        CHECK((info.fields & KVG_FIELD_ROW) && info.row == 1 && info.request == 2 && info.page == 4);
    }
    OK(kvg_get_page_info(t, 4, &page));
    CHECK(page.state == KVG_PAGE_STATE_OWNED && page.owner == 1);
    OK(kvg_get_page_info(t, 5, &page)); /* all or nothing: 2's first page was not kept */
    CHECK(page.state == KVG_PAGE_STATE_FREE);
    OK(kvg_get_page_info(t, 6, &page));
    CHECK(page.state == KVG_PAGE_STATE_OWNED && page.owner == 3);
    /* The claimed pages are the claimers' own: written and read. */
    OK(kvg_record_write_tokens(t, 1, pages, 2, 0, 20));
    OK(kvg_verify_read(t, 1, pages, 2, 20));
    /* No sequences: nothing to do. */
    OK(kvg_claim_step(t, 0, NULL, NULL, NULL, NULL));
    kvg_table_free(t);
}

/* Report policy: reads that violate are counted and let through. */
static void test_report_policy(void) {
    kvg_table *t = new_table(KVG_POLICY_REPORT, 0);
    const int32_t p3[1] = {3};
    uint64_t n = 0;
    kvg_request_info req;
    OK(kvg_admit(t, 1, 1, 16, 0));
    OK(kvg_admit(t, 2, 2, 16, 0));
    OK(kvg_claim(t, 1, p3, 1, NULL, 0));
    OK(kvg_record_write(t, 1, 3, 0, PS));
    OK(kvg_verify_read(t, 2, p3, 1, PS));
    OK(kvg_violation_count(t, KVG_VIOLATION_KIND_FOREIGN_PAGE, &n));
    CHECK(n == 1);
    req.struct_size = sizeof req;
    OK(kvg_get_request_info(t, 2, &req));
    CHECK(req.quarantined == 0);
    kvg_table_free(t);
}

/* The _refs forms of writes, releases, publishes and imports, and a request's page list. */
static void test_refs_forms(void) {
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    kvg_page_ref refs[3], listed[3], stale;
    size_t n = 99;
    const uint8_t key[] = "refs-prefix";
    OK(kvg_admit(t, 1, 1, 48, 0));
    OK(kvg_allocate(t, 1, 3, refs, 3));
    OK(kvg_record_write_tokens_refs(t, 1, refs, 3, 0, 40));
    OK(kvg_verify_read_refs(t, 1, refs, 3, 40));
    EXPECT(kvg_record_write_tokens_refs(t, 1, NULL, 3, 0, 40), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_record_write_tokens_refs(NULL, 1, refs, 3, 0, 40), KVG_STATUS_NULL_POINTER);

    /* The request's pages: the count alone, too small a buffer, then all of them. */
    OK(kvg_get_request_pages(t, 1, NULL, 0, &n));
    CHECK(n == 3);
    EXPECT(kvg_get_request_pages(t, 1, listed, 2, &n), KVG_STATUS_BUFFER_TOO_SMALL);
    CHECK(n == 3);
    OK(kvg_get_request_pages(t, 1, listed, 3, &n));
    CHECK(n == 3 && memcmp(listed, refs, sizeof refs) == 0);
    EXPECT(kvg_get_request_pages(t, 1, listed, 3, NULL), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_get_request_pages(t, 42, listed, 3, &n), KVG_STATUS_INVALID_ARGUMENT);
    CHECK(n == 0);
    EXPECT(kvg_get_request_pages(NULL, 1, listed, 3, &n), KVG_STATUS_NULL_POINTER);

    /* A release through a ref to a past incarnation frees nothing. */
    {
        kvg_released rel;
        memset(&rel, 0, sizeof rel);
        rel.struct_size = sizeof rel;
        stale = refs[2];
        OK(kvg_release_pages_refs(t, 1, &refs[2], 1, &rel));
        CHECK(rel.ended == 1);
        {
            const int32_t again[1] = {stale.page};
            OK(kvg_claim(t, 1, again, 1, &refs[2], 1));
        }
        CHECK(refs[2].generation == stale.generation + 1);
        VIOLATES(kvg_release_pages_refs(t, 1, &stale, 1, NULL), KVG_VIOLATION_KIND_STALE_PAGE);
        rel.struct_size = 4;
        EXPECT(kvg_release_pages_refs(t, 1, &refs[2], 1, &rel), KVG_STATUS_BAD_STRUCT_SIZE);
        EXPECT(kvg_release_pages_refs(t, 1, NULL, 1, NULL), KVG_STATUS_NULL_POINTER);
    }
    /* Publish through refs; a stale ref is refused. */
    VIOLATES(kvg_publish_prefix_refs(t, 1, key, sizeof key, &stale, 1), KVG_VIOLATION_KIND_STALE_PAGE);
    OK(kvg_publish_prefix_refs(t, 1, key, sizeof key, refs, 2));
    VIOLATES(kvg_publish_prefix_refs(t, 1, key, sizeof key, &refs[2], 1), KVG_VIOLATION_KIND_DUPLICATE_PREFIX);
    EXPECT(kvg_publish_prefix_refs(t, 1, key, 0, refs, 1), KVG_STATUS_INVALID_ARGUMENT);
    EXPECT(kvg_publish_prefix_refs(NULL, 1, key, sizeof key, refs, 1), KVG_STATUS_NULL_POINTER);

    /* Imports through refs. */
    OK(kvg_admit(t, 2, 1, 32, 0));
    OK(kvg_allocate(t, 2, 2, refs, 2));
    VIOLATES(kvg_record_import_refs(t, 2, refs, 2, 30, 32), KVG_VIOLATION_KIND_TOKEN_COUNT_MISMATCH);
    OK(kvg_release(t, 2, NULL));
    OK(kvg_admit(t, 3, 1, 32, 0));
    OK(kvg_allocate(t, 3, 2, listed, 2));
    OK(kvg_record_import_refs(t, 3, listed, 2, 32, 32));
    OK(kvg_verify_read_refs(t, 3, listed, 2, 32));
    EXPECT(kvg_record_import_refs(t, 3, NULL, 2, 32, 32), KVG_STATUS_NULL_POINTER);
    VIOLATES(kvg_record_write_tokens_refs(t, 3, listed, 1, 0, 32), KVG_VIOLATION_KIND_BLOCK_TABLE_TOO_SHORT);
    /* A reversed token range says so, through ids and through refs. */
    {
        const int32_t ids[2] = {listed[0].page, listed[1].page};
        kvg_violation_info info;
        VIOLATES(kvg_record_write_tokens(t, 3, ids, 2, 20, 10), KVG_VIOLATION_KIND_TOKEN_RANGE_REVERSED);
        info = last_info();
        CHECK(info.found == 20 && info.limit == 10 && strstr(info.message, "tokens 20..10") != NULL);
        VIOLATES(kvg_record_write_tokens_refs(t, 3, listed, 2, 20, 10), KVG_VIOLATION_KIND_TOKEN_RANGE_REVERSED);
    }
    kvg_table_free(t);
}

/* Import tickets: pinned pages, finish, abort, in-flight refusals. */
static void test_import_tickets(void) {
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    kvg_import_ticket *ticket = NULL, *other = NULL;
    kvg_page_ref refs[2];
    kvg_pool_snapshot snap;
    snap.struct_size = sizeof snap;
    OK(kvg_admit(t, 1, 1, 32, 0));
    OK(kvg_allocate(t, 1, 2, refs, 2));
    OK(kvg_begin_import(t, 1, refs, 2, &ticket));
    CHECK(ticket != NULL);
    VIOLATES(kvg_begin_import(t, 1, refs, 1, &other), KVG_VIOLATION_KIND_IMPORT_IN_FLIGHT);
    CHECK(other == NULL);
    OK(kvg_import_finish(ticket, 32, 32));
    {
        /* Recorded (request 1 itself is quarantined by the enforced import_in_flight). */
        kvg_page_info info;
        info.struct_size = sizeof info;
        OK(kvg_get_page_info(t, refs[1].page, &info));
        CHECK(info.written_slots == PS);
    }

    /* A release while bytes still land: the pages leave the request but stay pinned. */
    OK(kvg_admit(t, 2, 1, 32, 0));
    OK(kvg_allocate(t, 2, 2, refs, 2));
    OK(kvg_begin_import(t, 2, refs, 2, &ticket));
    OK(kvg_release(t, 2, NULL));
    OK(kvg_snapshot(t, &snap));
    CHECK(snap.in_flight == 2);
    /* Finishing now records nothing: the pages are no longer the request's. */
    EXPECT(kvg_import_finish(ticket, 32, 32), KVG_STATUS_VIOLATION);
    OK(kvg_snapshot(t, &snap));
    CHECK(snap.in_flight == 0);

    /* A count mismatch, and an abort. */
    OK(kvg_admit(t, 3, 1, 32, 0));
    OK(kvg_allocate(t, 3, 2, refs, 2));
    OK(kvg_begin_import(t, 3, refs, 2, &ticket));
    VIOLATES(kvg_import_finish(ticket, 30, 32), KVG_VIOLATION_KIND_TOKEN_COUNT_MISMATCH);
    OK(kvg_begin_import(t, 3, refs, 2, &ticket));
    kvg_import_abort(ticket);
    OK(kvg_begin_import(t, 3, refs, 2, &ticket)); /* unpinned by the abort */
    kvg_import_abort(ticket);

    /* The connector's own copy failed at page 1: coverage revoked (the request had written its
       first page itself), landing_failed recorded, the request not quarantined, the ticket
       ended once. */
    {
        kvg_page_info info;
        kvg_request_info rinfo;
        uint64_t failed = 0;
        int32_t pages[2] = {refs[0].page, refs[1].page};
        info.struct_size = sizeof info;
        rinfo.struct_size = sizeof rinfo;
        OK(kvg_admit(t, 4, 1, 32, 0));
        OK(kvg_allocate(t, 4, 2, refs, 2));
        pages[0] = refs[0].page;
        pages[1] = refs[1].page;
        OK(kvg_record_write_tokens(t, 4, pages, 2, 0, PS));
        OK(kvg_begin_import(t, 4, refs, 2, &ticket));
        OK(kvg_import_fail(ticket, 1));
        EXPECT(kvg_import_fail(ticket, 1), KVG_STATUS_INVALID_HANDLE);
        OK(kvg_get_page_info(t, refs[0].page, &info));
        CHECK(info.written_slots == 0);
        OK(kvg_violation_count(t, KVG_VIOLATION_KIND_LANDING_FAILED, &failed));
        CHECK(failed == 1);
        OK(kvg_get_request_info(t, 4, &rinfo));
        CHECK(!rinfo.quarantined);
        OK(kvg_snapshot(t, &snap));
        CHECK(snap.in_flight == 0);
        EXPECT(kvg_check_read(t, 4, pages, 2, 1), KVG_STATUS_VIOLATION);
        OK(kvg_record_write_tokens(t, 4, pages, 2, 0, 2 * PS)); /* recomputed: readable again */
        OK(kvg_check_read(t, 4, pages, 2, 2 * PS));
    }

    /* Refusals: another request's pages, NULLs. */
    VIOLATES(kvg_begin_import(t, 1, refs, 2, &ticket), KVG_VIOLATION_KIND_FOREIGN_PAGE);
    CHECK(ticket == NULL);
    EXPECT(kvg_begin_import(t, 3, refs, 2, NULL), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_begin_import(t, 3, NULL, 2, &ticket), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_begin_import(NULL, 3, refs, 2, &ticket), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_import_finish(NULL, 1, 1), KVG_STATUS_NULL_POINTER);
    kvg_import_abort(NULL);
    kvg_table_free(t);
}

struct landing {
    int calls;
    size_t bytes;
    int32_t pages[4];
    size_t fail_at; /* land_failing: the entry whose copy fails */
};

static int land(void *user, size_t index, kvg_page_ref page, const uint8_t *bytes, size_t len) {
    struct landing *l = user;
    (void)bytes;
    if (index < 4) l->pages[index] = page.page;
    l->calls++;
    l->bytes += len;
    return 0;
}

/* A copy into the pool that fails on entry `fail_at` (a cudaError_t, say). */
static int land_failing(void *user, size_t index, kvg_page_ref page, const uint8_t *bytes, size_t len) {
    struct landing *l = user;
    (void)page;
    (void)bytes;
    (void)len;
    l->calls++;
    return index == l->fail_at ? 700 : 0;
}

/* Manifests (build, encode, decode, inspect) and the receiver's accept. */
static void test_transfers(void) {
    enum { TOKENS = 20, SLOT = 4 };
    kvg_table *decode = new_table(KVG_POLICY_ENFORCE, 0);
    kvg_page_ref dest[2];
    int32_t prompt[TOKENS];
    uint8_t page0[PS * SLOT], page1[(TOKENS - PS) * SLOT];
    const uint8_t *pages[2] = {page0, page1};
    size_t lens[2] = {sizeof page0, sizeof page1};
    kvg_transfer_header header;
    kvg_manifest *m = NULL, *back = NULL;
    uint8_t wire[512];
    size_t wire_len = 0, n = 0;
    uint32_t crc = 0;
    uint64_t digest = 0;

    for (int i = 0; i < TOKENS; i++) prompt[i] = 1000 + i;
    for (size_t i = 0; i < sizeof page0; i++) page0[i] = (uint8_t)i;
    for (size_t i = 0; i < sizeof page1; i++) page1[i] = (uint8_t)(200 + i);
    OK(kvg_admit(decode, 7, 3, TOKENS, 8));
    OK(kvg_allocate(decode, 7, 2, dest, 2));

    /* The sender builds the manifest against the receiver's ids and refs. */
    memset(&header, 0, sizeof header);
    header.struct_size = sizeof header;
    header.request = 7;
    header.tenant = 3;
    header.sender = 11;
    header.page_size = PS;
    header.slot_bytes = SLOT;
    OK(kvg_manifest_build(&header, prompt, TOKENS, dest, 2, pages, lens, 2, &m));
    CHECK(m != NULL);
    OK(kvg_manifest_encode(m, NULL, 0, &wire_len));
    CHECK(wire_len > 0 && wire_len <= sizeof wire);
    EXPECT(kvg_manifest_encode(m, wire, wire_len - 1, &n), KVG_STATUS_BUFFER_TOO_SMALL);
    OK(kvg_manifest_encode(m, wire, sizeof wire, &n));
    CHECK(n == wire_len);
    EXPECT(kvg_manifest_encode(m, wire, sizeof wire, NULL), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_manifest_encode(NULL, wire, sizeof wire, &n), KVG_STATUS_NULL_POINTER);

    /* Decoded, it says what was built. */
    OK(kvg_manifest_decode(wire, wire_len, &back));
    {
        kvg_manifest_info info;
        kvg_manifest_page listed[2];
        info.struct_size = sizeof info;
        OK(kvg_manifest_get_info(back, &info));
        OK(kvg_prompt_digest(prompt, TOKENS, &digest));
        CHECK(info.request == 7 && info.tenant == 3 && info.sender == 11 && info.prompt_tokens == TOKENS);
        CHECK(info.prompt_digest == digest && info.page_size == PS && info.slot_bytes == SLOT && info.num_pages == 2);
        info.struct_size = 3;
        EXPECT(kvg_manifest_get_info(back, &info), KVG_STATUS_BAD_STRUCT_SIZE);
        EXPECT(kvg_manifest_get_info(back, NULL), KVG_STATUS_NULL_POINTER);
        OK(kvg_manifest_get_pages(back, NULL, 0, &n));
        CHECK(n == 2);
        EXPECT(kvg_manifest_get_pages(back, listed, 1, &n), KVG_STATUS_BUFFER_TOO_SMALL);
        OK(kvg_manifest_get_pages(back, listed, 2, &n));
        OK(kvg_page_checksum(page1, sizeof page1, &crc));
        CHECK(listed[0].dest.page == dest[0].page && listed[0].tokens == PS);
        CHECK(listed[1].tokens == TOKENS - PS && listed[1].crc32 == crc);
        EXPECT(kvg_manifest_get_pages(back, listed, 2, NULL), KVG_STATUS_NULL_POINTER);
    }
    kvg_manifest_free(back);
    kvg_manifest_free(NULL);

    /* Bytes that do not decode are refused as manifest_corrupt. */
    back = (kvg_manifest *)1;
    wire[wire_len / 2] ^= 0x40;
    VIOLATES(kvg_manifest_decode(wire, wire_len, &back), KVG_VIOLATION_KIND_MANIFEST_CORRUPT);
    CHECK(back == NULL);
    wire[wire_len / 2] ^= 0x40;
    VIOLATES(kvg_manifest_decode(wire, 3, &back), KVG_VIOLATION_KIND_MANIFEST_CORRUPT);
    EXPECT(kvg_manifest_decode(NULL, 3, &back), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_manifest_decode(wire, wire_len, NULL), KVG_STATUS_NULL_POINTER);

    /* A build of the wrong shape: a page of the wrong length, no pages, a bad header. */
    lens[1] = 3;
    EXPECT(kvg_manifest_build(&header, prompt, TOKENS, dest, 2, pages, lens, 2, &back), KVG_STATUS_INVALID_ARGUMENT);
    lens[1] = sizeof page1;
    EXPECT(kvg_manifest_build(&header, prompt, TOKENS, dest, 1, pages, lens, 1, &back), KVG_STATUS_INVALID_ARGUMENT);
    header.struct_size = 8;
    EXPECT(kvg_manifest_build(&header, prompt, TOKENS, dest, 2, pages, lens, 2, &back), KVG_STATUS_BAD_STRUCT_SIZE);
    header.struct_size = sizeof header;
    EXPECT(kvg_manifest_build(NULL, prompt, TOKENS, dest, 2, pages, lens, 2, &back), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_manifest_build(&header, prompt, TOKENS, dest, 2, NULL, lens, 2, &back), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_manifest_build(&header, prompt, TOKENS, dest, 2, pages, lens, 2, NULL), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_page_checksum(NULL, 4, &crc), KVG_STATUS_NULL_POINTER);
    EXPECT(kvg_prompt_digest(prompt, TOKENS, NULL), KVG_STATUS_NULL_POINTER);

    /* The receiver: a substituted prompt, a corrupted page, then the real transfer. */
    {
        kvg_expected_transfer expected;
        kvg_accepted accepted;
        struct landing landed;
        uint64_t before = 0, after = 0;
        memset(&expected, 0, sizeof expected);
        memset(&landed, 0, sizeof landed);
        expected.struct_size = sizeof expected;
        expected.request = 7;
        expected.tenant = 3;
        expected.sender = 11;
        expected.check_sender = 1;
        expected.page_size = PS;
        expected.slot_bytes = SLOT;
        expected.prompt = prompt;
        expected.prompt_len = TOKENS;
        expected.pages = dest;
        expected.num_pages = 2;
        accepted.struct_size = sizeof accepted;

        OK(kvg_violation_count(decode, 0, &before));
        prompt[3] = 5;
        VIOLATES(kvg_accept_transfer(decode, &expected, wire, wire_len, pages, lens, 2, land, &landed, &accepted),
                 KVG_VIOLATION_KIND_PROMPT_DIGEST_MISMATCH);
        prompt[3] = 1003;
        page1[0] ^= 1;
        VIOLATES(kvg_accept_transfer(decode, &expected, wire, wire_len, pages, lens, 2, land, &landed, NULL),
                 KVG_VIOLATION_KIND_PAGE_CHECKSUM_MISMATCH);
        CHECK(strstr(kvg_last_error_message(), "checksum") != NULL);
        page1[0] ^= 1;
        expected.sender = 12;
        VIOLATES(kvg_accept_transfer(decode, &expected, wire, wire_len, pages, lens, 2, land, &landed, NULL),
                 KVG_VIOLATION_KIND_TRANSFER_MISROUTED);
        expected.sender = 11;
        CHECK(landed.calls == 0); /* nothing landed from a refused transfer */
        OK(kvg_violation_count(decode, 0, &after));
        CHECK(after == before + 3); /* the table counted each refusal */
        /* The copy of either page fails: the import is abandoned, nothing is readable, and the
           failure is its own kind, naming the page; landing stopped there. */
        for (size_t fail_at = 0; fail_at < 2; fail_at++) {
            char want[32];
            kvg_violation_info v;
            landed.calls = 0;
            landed.fail_at = fail_at;
            VIOLATES(kvg_accept_transfer(decode, &expected, wire, wire_len, pages, lens, 2, land_failing, &landed,
                                         &accepted),
                     KVG_VIOLATION_KIND_LANDING_FAILED);
            CHECK(landed.calls == (int)fail_at + 1);
            snprintf(want, sizeof want, "landing page %zu", fail_at);
            CHECK(strstr(kvg_last_error_message(), want) != NULL);
            CHECK(strstr(kvg_last_error_message(), "returned 700") != NULL);
            v.struct_size = sizeof v;
            OK(kvg_last_violation(0, &v));
            CHECK(v.page == (uint32_t)dest[fail_at].page && v.block_index == fail_at);
            for (int i = 0; i < 2; i++) {
                kvg_page_info info;
                info.struct_size = sizeof info;
                OK(kvg_get_page_info(decode, dest[i].page, &info));
                CHECK(info.written_slots == 0);
            }
        }
        landed.calls = 0;
        /* Requests 7 is quarantined by the enforced refusals; accepting still lands and records. */
        OK(kvg_accept_transfer(decode, &expected, wire, wire_len, pages, lens, 2, land, &landed, &accepted));
        CHECK(accepted.tokens == TOKENS && accepted.pages == 2);
        CHECK(landed.calls == 2 && landed.bytes == sizeof page0 + sizeof page1 && landed.pages[1] == dest[1].page);
        {
            kvg_page_info info;
            info.struct_size = sizeof info;
            OK(kvg_get_page_info(decode, dest[1].page, &info));
            CHECK(info.written_slots == TOKENS - PS);
        }
        /* No land callback: the bytes are already in place; a second accept is stale-free but
           the pages are written already, which is fine. Bad arguments are refused. */
        OK(kvg_accept_transfer(decode, &expected, wire, wire_len, pages, lens, 2, NULL, NULL, NULL));
        expected.struct_size = 8;
        EXPECT(kvg_accept_transfer(decode, &expected, wire, wire_len, pages, lens, 2, NULL, NULL, NULL),
               KVG_STATUS_BAD_STRUCT_SIZE);
        expected.struct_size = sizeof expected;
        accepted.struct_size = 2;
        EXPECT(kvg_accept_transfer(decode, &expected, wire, wire_len, pages, lens, 2, NULL, NULL, &accepted),
               KVG_STATUS_BAD_STRUCT_SIZE);
        EXPECT(kvg_accept_transfer(decode, NULL, wire, wire_len, pages, lens, 2, NULL, NULL, NULL),
               KVG_STATUS_NULL_POINTER);
        EXPECT(kvg_accept_transfer(decode, &expected, NULL, wire_len, pages, lens, 2, NULL, NULL, NULL),
               KVG_STATUS_NULL_POINTER);
        EXPECT(kvg_accept_transfer(NULL, &expected, wire, wire_len, pages, lens, 2, NULL, NULL, NULL),
               KVG_STATUS_NULL_POINTER);
        /* The pages changed hands: the old refs are stale. */
        OK(kvg_release(decode, 7, NULL));
        EXPECT(kvg_accept_transfer(decode, &expected, wire, wire_len, pages, lens, 2, NULL, NULL, NULL),
               KVG_STATUS_VIOLATION);
    }
    kvg_manifest_free(m);
    kvg_table_free(decode);
}

/* Misused handles. A handle is an id kvguard looks up on every call, never an address it
   dereferences, and ids are never reused: a freed handle, one freed twice, one of another type
   or one kvguard never made is refused with KVG_STATUS_INVALID_HANDLE and a message, also after
   the allocator reused the memory. Run under AddressSanitizer by scripts/ci/c.sh: a crash, a
   read of freed memory or a leak fails it. */

/* The manifest of a one-page transfer of request 1 (tenant 1, one byte a slot) into `dest`. */
static kvg_manifest *one_page_manifest(kvg_page_ref dest, const int32_t *prompt, const uint8_t *page) {
    kvg_transfer_header header;
    const uint8_t *pages[1] = {page};
    size_t lens[1] = {PS};
    kvg_manifest *m = NULL;
    memset(&header, 0, sizeof header);
    header.struct_size = sizeof header;
    header.request = 1;
    header.tenant = 1;
    header.page_size = PS;
    header.slot_bytes = 1;
    OK(kvg_manifest_build(&header, prompt, PS, &dest, 1, pages, lens, 1, &m));
    return m;
}

static void test_handle_misuse(void) {
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0), *other;
    kvg_import_ticket *ticket = NULL, *aborted_by_free = NULL, *never_ended = NULL;
    kvg_manifest *m = NULL;
    kvg_page_ref refs[2], more[2], last[2];
    kvg_pool_snapshot snap;
    size_t live = kvg_live_handles();
    snap.struct_size = sizeof snap;
    CHECK(live == 1);

    /* Double free, use after free: a status, the thread's message says which. */
    OK(kvg_admit(t, 1, 1, 32, 0));
    OK(kvg_table_free(t));
    EXPECT(kvg_table_free(t), KVG_STATUS_INVALID_HANDLE);
    CHECK(strstr(kvg_last_error_message(), "already freed by kvg_table_free") != NULL);
    CHECK(kvg_last_status() == KVG_STATUS_INVALID_HANDLE);
    CHECK(strcmp(kvg_status_name(KVG_STATUS_INVALID_HANDLE), "invalid_handle") == 0);
    EXPECT(kvg_admit(t, 2, 1, 32, 0), KVG_STATUS_INVALID_HANDLE);
    EXPECT(kvg_snapshot(t, &snap), KVG_STATUS_INVALID_HANDLE);
    EXPECT(kvg_release(t, 1, NULL), KVG_STATUS_INVALID_HANDLE);
    /* Still refused once a new table exists (its memory may be the freed one's): the new
       handle is a new id, and the old one never names it. */
    other = new_table(KVG_POLICY_ENFORCE, 0);
    CHECK(other != t);
    EXPECT(kvg_admit(t, 1, 1, 32, 0), KVG_STATUS_INVALID_HANDLE);
    OK(kvg_admit(other, 1, 1, 32, 0));
    OK(kvg_table_free(NULL)); /* NULL stays a no-op */

    /* A ticket ended twice, either way. */
    OK(kvg_allocate(other, 1, 2, refs, 2));
    OK(kvg_begin_import(other, 1, refs, 2, &ticket));
    OK(kvg_import_finish(ticket, 32, 32));
    EXPECT(kvg_import_finish(ticket, 32, 32), KVG_STATUS_INVALID_HANDLE);
    CHECK(strstr(kvg_last_error_message(), "already ended") != NULL);
    EXPECT(kvg_import_abort(ticket), KVG_STATUS_INVALID_HANDLE);
    OK(kvg_begin_import(other, 1, refs, 2, &ticket));
    OK(kvg_import_abort(ticket));
    EXPECT(kvg_import_abort(ticket), KVG_STATUS_INVALID_HANDLE);
    EXPECT(kvg_import_finish(ticket, 32, 32), KVG_STATUS_INVALID_HANDLE);
    OK(kvg_import_abort(NULL));

    /* A handle of another type, and values kvguard never made. */
    OK(kvg_begin_import(other, 1, refs, 2, &ticket));
    EXPECT(kvg_admit((kvg_table *)(void *)ticket, 9, 1, 16, 0), KVG_STATUS_INVALID_HANDLE);
    CHECK(strstr(kvg_last_error_message(), "kvg_import_ticket handle, not a kvg_table") != NULL);
    EXPECT(kvg_table_free((kvg_table *)(void *)ticket), KVG_STATUS_INVALID_HANDLE);
    EXPECT(kvg_import_finish((kvg_import_ticket *)(void *)other, 1, 1), KVG_STATUS_INVALID_HANDLE);
    EXPECT(kvg_admit((kvg_table *)(void *)&snap, 9, 1, 16, 0), KVG_STATUS_INVALID_HANDLE);
    CHECK(strstr(kvg_last_error_message(), "never made by kvguard") != NULL);
    EXPECT(kvg_import_abort((kvg_import_ticket *)(void *)&snap), KVG_STATUS_INVALID_HANDLE);
    OK(kvg_import_abort(ticket));

    /* A manifest freed twice, or read after its free. */
    {
        int32_t prompt[PS];
        uint8_t page[PS];
        size_t len = 0;
        for (int i = 0; i < PS; i++) prompt[i] = i;
        memset(page, 7, sizeof page);
        m = one_page_manifest(refs[0], prompt, page);
        OK(kvg_manifest_encode(m, NULL, 0, &len));
        OK(kvg_manifest_free(m));
        EXPECT(kvg_manifest_free(m), KVG_STATUS_INVALID_HANDLE);
        CHECK(strstr(kvg_last_error_message(), "already freed by kvg_manifest_free") != NULL);
        EXPECT(kvg_manifest_encode(m, NULL, 0, &len), KVG_STATUS_INVALID_HANDLE);
        EXPECT(kvg_manifest_free((kvg_manifest *)(void *)other), KVG_STATUS_INVALID_HANDLE);
        OK(kvg_manifest_free(NULL));
    }

    /* Tickets still open when their table is freed: kvg_table_free aborts and frees them (no
       leak, nothing read after its free); ending one afterwards is a status. One is never
       touched again: the sanitizer's leak check says it went with its table. */
    OK(kvg_admit(other, 2, 1, 32, 0));
    OK(kvg_allocate(other, 2, 2, more, 2));
    OK(kvg_admit(other, 3, 1, 32, 0));
    OK(kvg_allocate(other, 3, 2, last, 2));
    OK(kvg_begin_import(other, 1, refs, 2, &ticket));
    OK(kvg_begin_import(other, 2, more, 2, &aborted_by_free));
    OK(kvg_begin_import(other, 3, last, 2, &never_ended));
    OK(kvg_import_finish(ticket, 32, 32)); /* ended before the free: unaffected */
    OK(kvg_table_free(other));
    EXPECT(kvg_import_finish(aborted_by_free, 32, 32), KVG_STATUS_INVALID_HANDLE);
    CHECK(strstr(kvg_last_error_message(), "aborted by kvg_table_free of its table") != NULL);
    EXPECT(kvg_import_abort(aborted_by_free), KVG_STATUS_INVALID_HANDLE);
    EXPECT(kvg_begin_import(other, 3, last, 2, &ticket), KVG_STATUS_INVALID_HANDLE);
    CHECK(kvg_live_handles() == 0); /* the never-ended ticket went with its table */

    /* A free that succeeds leaves the thread's last error readable. */
    t = new_table(KVG_POLICY_ENFORCE, 0);
    EXPECT(kvg_admit(t, 1, 1, 1u << 30, 0), KVG_STATUS_VIOLATION);
    OK(kvg_table_free(t));
    CHECK(kvg_last_status() == KVG_STATUS_VIOLATION);
    CHECK(strstr(kvg_last_error_message(), "exceeds_max_context") != NULL);
}

/* A table freed while a call runs on it (here, by the call's own `land` callback, as another
   thread could): the call finishes on the table, which goes when the call returns; the next
   call is refused. */
struct freeing {
    kvg_table *table;
    kvg_status freed;
};

static int land_and_free(void *user, size_t index, kvg_page_ref page, const uint8_t *bytes, size_t len) {
    struct freeing *f = user;
    (void)index;
    (void)page;
    (void)bytes;
    (void)len;
    f->freed = kvg_table_free(f->table);
    return 0;
}

static void test_free_during_a_call(void) {
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    kvg_page_ref dest[1];
    int32_t prompt[PS];
    uint8_t page[PS], wire[512];
    const uint8_t *pages[1] = {page};
    size_t lens[1] = {sizeof page}, wire_len = 0;
    kvg_expected_transfer expected;
    kvg_accepted accepted;
    kvg_manifest *m = NULL;
    struct freeing f = {t, KVG_STATUS_OTHER};

    for (int i = 0; i < PS; i++) prompt[i] = 100 + i;
    memset(page, 3, sizeof page);
    OK(kvg_admit(t, 1, 1, PS, 0));
    OK(kvg_allocate(t, 1, 1, dest, 1));
    m = one_page_manifest(dest[0], prompt, page);
    OK(kvg_manifest_encode(m, wire, sizeof wire, &wire_len));
    OK(kvg_manifest_free(m));
    memset(&expected, 0, sizeof expected);
    expected.struct_size = sizeof expected;
    expected.request = 1;
    expected.tenant = 1;
    expected.page_size = PS;
    expected.slot_bytes = 1;
    expected.prompt = prompt;
    expected.prompt_len = PS;
    expected.pages = dest;
    expected.num_pages = 1;
    accepted.struct_size = sizeof accepted;

    OK(kvg_accept_transfer(t, &expected, wire, wire_len, pages, lens, 1, land_and_free, &f, &accepted));
    CHECK(f.freed == KVG_STATUS_OK);
    CHECK(accepted.tokens == PS && accepted.pages == 1);
    EXPECT(kvg_admit(t, 2, 1, PS, 0), KVG_STATUS_INVALID_HANDLE);
    CHECK(kvg_live_handles() == 0); /* gone when the call returned */
}

/* Several threads on one table: each its own requests, allocating, writing, reading a step and
   releasing, while the others do the same; nothing may be refused and nothing lost. */
enum { THREADS = 4, ROUNDS = 200, SEQS = 3 };

static void *thread_body(void *arg) {
    kvg_table *t = arg;
    static atomic_int next_id;
    for (int round = 0; round < ROUNDS; round++) {
        uint64_t ids[SEQS];
        int32_t matrix[SEQS * 2];
        int32_t lens[SEQS];
        uint8_t refused[SEQS];
        kvg_page_ref refs[2];
        for (int s = 0; s < SEQS; s++) {
            ids[s] = (uint64_t)atomic_fetch_add(&next_id, 1) + 1;
            lens[s] = PS + 1;
            OK(kvg_admit(t, ids[s], ids[s] % 3, PS + 1, 0));
            OK(kvg_allocate(t, ids[s], 2, refs, 2));
            matrix[s * 2] = refs[0].page;
            matrix[s * 2 + 1] = refs[1].page;
            OK(kvg_record_write_tokens(t, ids[s], &matrix[s * 2], 2, 0, PS + 1));
        }
        OK(kvg_verify_step(t, SEQS, ids, matrix, 2, 2, lens, refused));
        /* Another thread's pages are foreign to this one's requests. */
        CHECK(kvg_check_read(t, ids[0], &matrix[2], 1, 1) == KVG_STATUS_VIOLATION);
        for (int s = 0; s < SEQS; s++) OK(kvg_release(t, ids[s], NULL));
    }
    return NULL;
}

static void test_threads(void) {
    kvg_table *t = new_table(KVG_POLICY_ENFORCE, 0);
    pthread_t threads[THREADS];
    kvg_pool_snapshot snap;
    for (int i = 0; i < THREADS; i++) CHECK(pthread_create(&threads[i], NULL, thread_body, t) == 0);
    for (int i = 0; i < THREADS; i++) CHECK(pthread_join(threads[i], NULL) == 0);
    snap.struct_size = sizeof snap;
    OK(kvg_snapshot(t, &snap));
    CHECK(snap.free == PAGES - 1 && snap.requests == 0 && snap.violations == 0);
    kvg_table_free(t);
}

int main(void) {
    test_names_and_version();
    test_config_and_sizes();
    test_newer_callers();
    test_null_table_and_pointers();
    test_allocator_mode();
    test_shadow_mode_and_scrub();
    test_prefixes();
    test_every_violation_kind();
    test_steps();
    test_rows();
    test_slot_rows();
    test_slot_rows_cached();
    test_held_rows();
    test_write_decode_rows();
    test_engine_step();
    test_claim_step();
    test_report_policy();
    test_refs_forms();
    test_import_tickets();
    test_transfers();
    test_handle_misuse();
    test_free_during_a_call();
    test_threads();
    CHECK(kvg_live_handles() == 0); /* every test freed what it made */
    printf("%d passed, %d failed\n", atomic_load(&passed), atomic_load(&failed));
    return atomic_load(&failed) == 0 ? 0 : 1;
}
