// The four cuBLAS calls the training example makes (cublasCreate_v2, cublasSetStream_v2,
// cublasSgemm_v2, cublasDestroy_v2), on the fake driver's streams: the same library is also
// installed as libcublas.so, so both share one state. SGEMM is the plain column-major product,
// queued on the handle's stream with its reads and write checked like any other operation.
#include <cstring>

#include "fake.h"

namespace {

enum Status : int { STATUS_SUCCESS = 0, STATUS_NOT_INITIALIZED = 1, STATUS_INVALID_VALUE = 7 };

struct Handle {
    void *stream = nullptr;
    bool destroyed = false;
};

std::vector<std::unique_ptr<Handle>> handles;

Handle *handle_of(void *h, const char *call) {
    for (auto &candidate : handles)
        if (candidate.get() == h) {
            if (candidate->destroyed) fake::die(fake::format("%s with a destroyed cuBLAS handle", call));
            return candidate.get();
        }
    fake::die(fake::format("%s with an unknown cuBLAS handle %p", call, h));
}

}  // namespace

using namespace fake;

FAKE_API int cublasCreate_v2(void **handle) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (require_context("cublasCreate_v2")) return STATUS_NOT_INITIALIZED;
    if (int e = injected("cublasCreate_v2")) return e;
    if (handle == nullptr) return STATUS_INVALID_VALUE;
    handles.push_back(std::make_unique<Handle>());
    *handle = handles.back().get();
    return STATUS_SUCCESS;
}

FAKE_API int cublasDestroy_v2(void *handle) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    handle_of(handle, "cublasDestroy_v2")->destroyed = true;
    return STATUS_SUCCESS;
}

FAKE_API int cublasSetStream_v2(void *handle, void *stream) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    Handle *h = handle_of(handle, "cublasSetStream_v2");
    stream_of(stream, "cublasSetStream_v2");  // a valid stream
    h->stream = stream;
    return STATUS_SUCCESS;
}

namespace {

// The device allocation a column-major matrix of `rows` x `cols` (leading dimension `ld`) at
// `address` lies in, checked to hold all of it.
Allocation *matrix(const char *name, const float *address, int rows, int cols, int ld) {
    size_t elements = size_t(ld) * size_t(cols - 1) + size_t(rows);
    Allocation *a = find_allocation(uintptr_t(address), elements * 4, MemoryKind::Device);
    if (a == nullptr)
        die(format("cublasSgemm_v2: matrix %s (%d x %d, leading dimension %d, %zu bytes at %p) "
                   "is not inside one device allocation",
                   name, rows, cols, ld, elements * 4, static_cast<const void *>(address)));
    return a;
}

}  // namespace

FAKE_API int cublasSgemm_v2(void *handle, int transa, int transb, int m, int n, int k,
                            const float *alpha, const float *A, int lda, const float *B, int ldb,
                            const float *beta, float *C, int ldc) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (require_context("cublasSgemm_v2")) return 13;  // CUBLAS_STATUS_EXECUTION_FAILED
    Handle *h = handle_of(handle, "cublasSgemm_v2");
    if (int e = injected("cublasSgemm_v2")) return e;
    if (m < 0 || n < 0 || k < 0 || transa < 0 || transa > 1 || transb < 0 || transb > 1 ||
        alpha == nullptr || beta == nullptr)
        return STATUS_INVALID_VALUE;
    if (ldc < (m > 1 ? m : 1) || lda < (transa ? (k > 1 ? k : 1) : (m > 1 ? m : 1)) ||
        ldb < (transb ? (n > 1 ? n : 1) : (k > 1 ? k : 1)))
        return STATUS_INVALID_VALUE;
    if (m == 0 || n == 0) return STATUS_SUCCESS;
    // alpha and beta are read now (host pointer mode).
    float a_scale = *alpha, c_scale = *beta;
    Stream *s = stream_of(h->stream, "cublasSgemm_v2");
    Op *op = new Op;
    op->stream = s;
    op->what = format("cublasSgemm_v2 (%d x %d x %d) on %s", m, n, k, s->describe().c_str());
    Clock clock = prepare(op);
    if (k > 0) {
        Allocation *a = matrix("A", A, transa ? k : m, transa ? m : k, lda);
        Allocation *b = matrix("B", B, transb ? n : k, transb ? k : n, ldb);
        check_read(a, s->agent, op->seq, clock, op->what + " (A)");
        check_read(b, s->agent, op->seq, clock, op->what + " (B)");
    }
    Allocation *c = matrix("C", C, m, n, ldc);
    check_write(c, s->agent, op->seq, clock, op->what + " (C)");
    op->run = [=] {
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                float sum = 0.f;
                for (int l = 0; l < k; l++) {
                    float x = transa ? A[l + size_t(i) * lda] : A[i + size_t(l) * lda];
                    float y = transb ? B[j + size_t(l) * ldb] : B[l + size_t(j) * ldb];
                    sum += x * y;
                }
                float &out = C[i + size_t(j) * ldc];
                out = a_scale * sum + (c_scale == 0.f ? 0.f : c_scale * out);
            }
    };
    commit(op, clock);
    st.blas_calls++;
    return STATUS_SUCCESS;
}
