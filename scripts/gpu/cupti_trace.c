// A CUDA injection library that records a program's GPU timeline with CUPTI's activity API:
// every kernel, memcpy and memset (start, end, stream, correlation id, name) and, with
// CUPTI_TRACE_API=1, every driver API call (start, end, correlation id, name), so
// that scripts/gpu/timeline.py can split a step's wall time into kernel time and the GPU's idle
// gaps, and say which host calls the gaps sit behind. Nsight Systems makes no reports on the
// device machine and Nsight Compute serialises kernels, so neither shows the gaps.
//
// Built by scripts/gpu/cupti_trace.sh (here, against the nvidia-cuda-cupti wheel's headers);
// used as
//   CUDA_INJECTION64_PATH=/path/libvime_cupti_trace.so CUPTI_TRACE_OUT=trace.txt program ...
// The CUDA driver calls InitializeInjection() at cuInit; the records are flushed at exit.
// Output lines (times in ns, CUPTI's clock):
//   K start end stream corr name      a kernel
//   C start end stream corr bytes     a memcpy
//   S start end stream corr bytes     a memset
//   A start end corr name             a driver API call (CUPTI_TRACE_API=1)
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static FILE *out;

#define CHECK(call)                                                                              \
    do {                                                                                         \
        CUptiResult r_ = (call);                                                                 \
        if (r_ != CUPTI_SUCCESS) {                                                               \
            const char *s_ = "?";                                                                \
            cuptiGetResultString(r_, &s_);                                                       \
            fprintf(stderr, "cupti_trace: %s failed: %s\n", #call, s_);                          \
        }                                                                                        \
    } while (0)

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *size = 16u << 20;
    *buffer = aligned_alloc(8, *size);
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                      size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *rec = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        switch (rec->kind) {
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
        case CUPTI_ACTIVITY_KIND_KERNEL: {
            CUpti_ActivityKernel10 *k = (CUpti_ActivityKernel10 *)rec;
            fprintf(out, "K %llu %llu %u %u %s\n", (unsigned long long)k->start,
                    (unsigned long long)k->end, k->streamId, k->correlationId,
                    k->name ? k->name : "?");
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            CUpti_ActivityMemcpy6 *m = (CUpti_ActivityMemcpy6 *)rec;
            fprintf(out, "C %llu %llu %u %u %llu\n", (unsigned long long)m->start,
                    (unsigned long long)m->end, m->streamId, m->correlationId,
                    (unsigned long long)m->bytes);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            CUpti_ActivityMemset4 *m = (CUpti_ActivityMemset4 *)rec;
            fprintf(out, "S %llu %llu %u %u %llu\n", (unsigned long long)m->start,
                    (unsigned long long)m->end, m->streamId, m->correlationId,
                    (unsigned long long)m->bytes);
            break;
        }
        case CUPTI_ACTIVITY_KIND_DRIVER: {
            CUpti_ActivityAPI *a = (CUpti_ActivityAPI *)rec;
            const char *name = "?";
            cuptiGetCallbackName(CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &name);
            fprintf(out, "A %llu %llu %u %s\n", (unsigned long long)a->start,
                    (unsigned long long)a->end, a->correlationId, name);
            break;
        }
        default:
            break;
        }
    }
    size_t dropped = 0;
    cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped);
    if (dropped)
        fprintf(stderr, "cupti_trace: %zu records dropped\n", dropped);
    free(buffer);
}

static void at_exit(void) {
    CHECK(cuptiActivityFlushAll(1));
    if (out) {
        fflush(out);
        fclose(out);
        out = NULL;
    }
}

int InitializeInjection(void) {
    const char *path = getenv("CUPTI_TRACE_OUT");
    out = fopen(path ? path : "cupti_trace.txt", "w");
    if (!out) {
        perror("cupti_trace: open CUPTI_TRACE_OUT");
        return 0;
    }
    CHECK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
    CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
    CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY));
    CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET));
    const char *api = getenv("CUPTI_TRACE_API");
    if (api && strcmp(api, "1") == 0)
        CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER));
    atexit(at_exit);
    return 1;
}
