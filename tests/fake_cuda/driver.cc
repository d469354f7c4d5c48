// The CUDA driver entry points of the fake (the ones cudarc reaches for imagefeed's GPU feed and
// the training example; docs/gpu.md lists them), its one device and primary context, and fault
// injection.
//
// Settings, from the environment when the driver is initialized:
//   IMAGEFEED_FAKE_CUDA_SEED=N          the streams' random delays (default 1)
//   IMAGEFEED_FAKE_CUDA_MAX_DELAY_US=N  the longest delay before a queued operation runs (200)
//   IMAGEFEED_FAKE_CUDA_FAIL=SPEC       calls that fail (see injected() below)
//   IMAGEFEED_FAKE_CUDA_STUB=1          behave as the CUDA toolkit's stub libcuda.so does
//   IMAGEFEED_FAKE_CUDA_TRACE=1         print every operation queued and run
#include <chrono>
#include <cstdarg>
#include <cstdlib>
#include <cstring>

#include "fake.h"

namespace fake {

namespace {

State *the_state = nullptr;
std::once_flag state_once;
thread_local Context *current = nullptr;

// Fault injection: per call name, which calls (counted from when the rule was set) fail, and how.
struct Rule {
    std::string call;
    uint64_t nth = 1;  // 0: every call
    int code = 0;      // -1: a launch that fails while it runs
    uint64_t seen = 0;
};
// From IMAGEFEED_FAKE_CUDA_FAIL, and from imagefeed_fake_cuda_inject (which replaces only its own).
std::vector<Rule> env_rules, test_rules;

// The calls that can be made to fail.
const char *const INJECTABLE[] = {
    "cuInit", "cuDevicePrimaryCtxRetain", "cuModuleLoadData", "cuLaunchKernel",
    "cuMemAllocAsync", "cuMemAlloc_v2", "cuMemFreeAsync", "cuMemHostAlloc", "cuMemsetD8Async",
    "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoH_v2", "cuStreamCreate", "cuStreamSynchronize",
    "cuStreamWaitEvent", "cuEventCreate", "cuEventDestroy_v2", "cuEventRecord",
    "cuEventSynchronize", "cublasCreate_v2", "cublasSgemm_v2",
};

int default_code(const std::string &call) {
    if (call.rfind("cublas", 0) == 0) return 13;  // CUBLAS_STATUS_EXECUTION_FAILED
    if (call.find("Alloc") != std::string::npos) return OUT_OF_MEMORY;
    if (call == "cuLaunchKernel") return LAUNCH_FAILED;
    return INVALID_VALUE;
}

bool all_digits(const std::string &text) {
    return !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
}

// "NAME[@N][=CODE|=sticky],..." (N = 0: every call; CODE a positive number); false when
// malformed or naming a call that cannot fail here.
bool parse_rules(const char *spec, std::vector<Rule> &out) {
    std::string text(spec);
    size_t p = 0;
    while (p < text.size()) {
        size_t comma = text.find(',', p);
        if (comma == std::string::npos) comma = text.size();
        std::string item = text.substr(p, comma - p);
        p = comma + 1;
        if (item.empty()) continue;
        Rule rule;
        size_t at = item.find('@'), eq = item.find('=');
        rule.call = item.substr(0, std::min(at, eq));
        bool known = false;
        for (const char *name : INJECTABLE) known = known || rule.call == name;
        if (!known) return false;
        if (at != std::string::npos) {
            std::string n = item.substr(at + 1, eq == std::string::npos ? std::string::npos : eq - at - 1);
            if (!all_digits(n)) return false;
            rule.nth = strtoull(n.c_str(), nullptr, 10);
        }
        if (eq != std::string::npos) {
            std::string code = item.substr(eq + 1);
            if (code == "sticky" && rule.call == "cuLaunchKernel") {
                rule.code = -1;
            } else if (all_digits(code) && atoi(code.c_str()) > 0) {
                rule.code = atoi(code.c_str());
            } else {
                return false;
            }
        } else {
            rule.code = default_code(rule.call);
        }
        out.push_back(rule);
    }
    return true;
}

void initialize_state() {
    the_state = new State;  // never freed: stream threads may outlive static destructors
    State &s = *the_state;
    if (const char *v = getenv("IMAGEFEED_FAKE_CUDA_SEED")) s.seed = strtoull(v, nullptr, 10);
    if (const char *v = getenv("IMAGEFEED_FAKE_CUDA_MAX_DELAY_US"))
        s.max_delay_us = strtoull(v, nullptr, 10);
    if (const char *v = getenv("IMAGEFEED_FAKE_CUDA_TRACE")) s.trace = *v && *v != '0';
    if (const char *v = getenv("IMAGEFEED_FAKE_CUDA_FAIL"))
        if (!parse_rules(v, env_rules))
            die(format("IMAGEFEED_FAKE_CUDA_FAIL=%s: not NAME[@N][=CODE|=sticky],... with NAME a "
                       "call that can fail here (see INJECTABLE in tests/fake_cuda/driver.cc)",
                       v));
    s.streams.emplace_back();  // agent 0 is the host
    add_stream(s, 0);          // agent 1, the legacy default stream
}

const char *stub() {
    const char *v = getenv("IMAGEFEED_FAKE_CUDA_STUB");
    return v && *v && *v != '0' ? v : nullptr;
}

}  // namespace

State &state() {
    std::call_once(state_once, initialize_state);
    return *the_state;
}

double now_ms() {
    static const auto start = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
        .count();
}

std::string format(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    char small[512];
    va_list copy;
    va_copy(copy, args);
    int n = vsnprintf(small, sizeof small, fmt, copy);
    va_end(copy);
    std::string out;
    if (n < int(sizeof small)) {
        out = small;
    } else {
        out.resize(size_t(n) + 1);
        vsnprintf(&out[0], out.size(), fmt, args);
        out.resize(size_t(n));
    }
    va_end(args);
    return out;
}

void die(const std::string &message) {
    fprintf(stderr, "imagefeed fake CUDA: %s\n", message.c_str());
    fflush(stderr);
    abort();
}

const char *result_name(int code) {
    switch (code) {
        case SUCCESS: return "CUDA_SUCCESS";
        case INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
        case OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
        case NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
        case STUB_LIBRARY: return "CUDA_ERROR_STUB_LIBRARY";
        case NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
        case INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
        case INVALID_IMAGE: return "CUDA_ERROR_INVALID_IMAGE";
        case INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
        case INVALID_PTX: return "CUDA_ERROR_INVALID_PTX";
        case INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
        case NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
        case NOT_READY: return "CUDA_ERROR_NOT_READY";
        case ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
        case LAUNCH_FAILED: return "CUDA_ERROR_LAUNCH_FAILED";
        default: return nullptr;
    }
}

Context *current_context() { return current; }

int require_context(const char *call) {
    State &st = state();
    if (!st.initialized) die(format("%s before cuInit", call));
    if (current == nullptr)
        die(format("%s called on a thread with no current context (cuCtxSetCurrent first)", call));
    if (current->retained <= 0)
        die(format("%s called with a current context that was released", call));
    return current->sticky_error;
}

int injected(const char *call) {
    int code = 0;
    for (auto *rules : {&env_rules, &test_rules})
        for (auto &rule : *rules) {
            if (rule.call != call) continue;
            rule.seen++;
            if (code == 0 && (rule.nth == 0 || rule.seen == rule.nth)) code = rule.code;
        }
    return code;
}

}  // namespace fake

using namespace fake;

// ---- initialization, devices, contexts ------------------------------------------------------

FAKE_API int cuInit(unsigned flags) {
    if (stub()) return STUB_LIBRARY;
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (flags != 0) return INVALID_VALUE;
    if (int e = injected("cuInit")) return e;
    if (!st.initialized) install_fault_handler();
    st.initialized = true;
    return SUCCESS;
}

FAKE_API int cuDriverGetVersion(int *version) {
    if (version == nullptr) return INVALID_VALUE;
    *version = 12080;
    return SUCCESS;
}

FAKE_API int cuDeviceGetCount(int *count) {
    if (stub()) return STUB_LIBRARY;
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (!st.initialized) return NOT_INITIALIZED;
    if (count == nullptr) return INVALID_VALUE;
    *count = 1;
    return SUCCESS;
}

FAKE_API int cuDeviceGet(int *device, int ordinal) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (!st.initialized) return NOT_INITIALIZED;
    if (device == nullptr) return INVALID_VALUE;
    if (ordinal != 0) return INVALID_DEVICE;
    *device = 0;
    return SUCCESS;
}

FAKE_API int cuDeviceGetName(char *name, int len, int device) {
    if (device != 0) return INVALID_DEVICE;
    if (name == nullptr || len <= 0) return INVALID_VALUE;
    snprintf(name, size_t(len), "imagefeed fake CUDA device (host memory, no GPU)");
    return SUCCESS;
}

FAKE_API int cuDeviceGetAttribute(int *value, int attribute, int device) {
    if (device != 0) return INVALID_DEVICE;
    if (value == nullptr) return INVALID_VALUE;
    switch (attribute) {
        case 1: *value = 1024; break;             // max threads per block
        case 2: case 3: case 4: *value = 1024; break;
        case 5: *value = 2147483647; break;       // max grid x
        case 6: case 7: *value = 65535; break;
        case 16: *value = 132; break;             // multiprocessors
        case 75: *value = 9; break;               // compute capability major
        case 76: *value = 0; break;               // minor
        case 115: *value = 1; break;              // memory pools supported
        default: *value = 0; break;
    }
    return SUCCESS;
}

FAKE_API int cuDevicePrimaryCtxRetain(void **ctx, int device) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (!st.initialized) return NOT_INITIALIZED;
    if (device != 0) return INVALID_DEVICE;
    if (int e = injected("cuDevicePrimaryCtxRetain")) return e;
    st.context.retained++;
    *ctx = &st.context;
    return SUCCESS;
}

FAKE_API int cuDevicePrimaryCtxRelease_v2(int device) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (device != 0) return INVALID_DEVICE;
    if (st.context.retained <= 0) die("cuDevicePrimaryCtxRelease_v2 of a context not retained");
    st.context.retained--;
    return SUCCESS;
}

FAKE_API int cuCtxGetCurrent(void **ctx) {
    if (ctx == nullptr) return INVALID_VALUE;
    *ctx = current;
    return SUCCESS;
}

FAKE_API int cuCtxSetCurrent(void *ctx) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (ctx != nullptr && ctx != &st.context) die(format("cuCtxSetCurrent(%p): not a context", ctx));
    if (ctx != nullptr && st.context.retained <= 0)
        die("cuCtxSetCurrent of a context that was released");
    current = static_cast<Context *>(ctx);
    return SUCCESS;
}

FAKE_API int cuCtxSynchronize() {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuCtxSynchronize")) return e;
    for (size_t i = NULL_STREAM; i < st.streams.size(); i++)
        synchronize_stream(lock, st.streams[i].get());
    return st.context.sticky_error;
}

FAKE_API int cuGetErrorString(int error, const char **text) {
    if (text == nullptr) return INVALID_VALUE;
    const char *name = result_name(error);
    if (name == nullptr) return INVALID_VALUE;
    *text = name;
    return SUCCESS;
}

FAKE_API int cuGetErrorName(int error, const char **text) { return cuGetErrorString(error, text); }

// ---- memory ---------------------------------------------------------------------------------

FAKE_API int cuMemAllocAsync(unsigned long long *dptr, size_t size, void *stream) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuMemAllocAsync")) return e;
    if (int e = injected("cuMemAllocAsync")) return e;
    if (dptr == nullptr || size == 0) return INVALID_VALUE;
    Stream *s = stream_of(stream, "cuMemAllocAsync");
    Op *op = new Op;
    op->stream = s;
    Clock clock = prepare(op);
    op->what = format("cuMemAllocAsync of %zu bytes on %s", size, s->describe().c_str());
    Allocation *a = new_device_allocation(size, op->what);
    if (a == nullptr) {
        delete op;
        return OUT_OF_MEMORY;
    }
    // Allocated in stream order: a use elsewhere must be ordered after it.
    check_write(a, s->agent, op->seq, clock, op->what);
    commit(op, clock);
    *dptr = a->base;
    return SUCCESS;
}

FAKE_API int cuMemAlloc_v2(unsigned long long *dptr, size_t size) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuMemAlloc_v2")) return e;
    if (int e = injected("cuMemAlloc_v2")) return e;
    if (dptr == nullptr || size == 0) return INVALID_VALUE;
    Allocation *a = new_device_allocation(size, format("cuMemAlloc_v2 of %zu bytes", size));
    if (a == nullptr) return OUT_OF_MEMORY;
    *dptr = a->base;
    return SUCCESS;
}

namespace {

Allocation *device_allocation_at(unsigned long long address, size_t len, const char *call) {
    Allocation *a = find_allocation(uintptr_t(address), len, MemoryKind::Device);
    if (a == nullptr) {
        Allocation *start = find_allocation(uintptr_t(address), 0, MemoryKind::Device);
        if (start != nullptr)
            die(format("%s of %zu bytes at 0x%llx runs past the end of %s", call, len, address,
                       start->describe().c_str()));
        die(format("%s: 0x%llx is not in any device allocation", call, address));
    }
    return a;
}

}  // namespace

FAKE_API int cuMemFreeAsync(unsigned long long dptr, void *stream) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuMemFreeAsync")) return e;
    if (int e = injected("cuMemFreeAsync")) return e;
    Allocation *a = device_allocation_at(dptr, 0, "cuMemFreeAsync");
    if (a->base != dptr) die(format("cuMemFreeAsync(0x%llx) inside %s, not its start", dptr, a->describe().c_str()));
    Stream *s = stream_of(stream, "cuMemFreeAsync");
    Op *op = new Op;
    op->stream = s;
    op->what = format("cuMemFreeAsync on %s", s->describe().c_str());
    Clock clock = prepare(op);
    check_write(a, s->agent, op->seq, clock, op->what);
    a->freed = true;
    a->freed_by = op->what;
    op->frees = a;
    commit(op, clock);
    return SUCCESS;
}

FAKE_API int cuMemFree_v2(unsigned long long dptr) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuMemFree_v2")) return e;
    Allocation *a = device_allocation_at(dptr, 0, "cuMemFree_v2");
    if (a->base != dptr) die(format("cuMemFree_v2(0x%llx) inside %s, not its start", dptr, a->describe().c_str()));
    if (a->freed) die(format("cuMemFree_v2 of %s, which %s already freed", a->describe().c_str(), a->freed_by.c_str()));
    // cuMemFree waits for the device.
    for (size_t i = NULL_STREAM; i < st.streams.size(); i++) synchronize_stream(lock, st.streams[i].get());
    a->freed = true;
    a->freed_by = "cuMemFree_v2";
    release_memory(a);
    return SUCCESS;
}

FAKE_API int cuMemHostAlloc(void **pointer, size_t size, unsigned flags) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuMemHostAlloc")) return e;
    if (int e = injected("cuMemHostAlloc")) return e;
    if (pointer == nullptr || size == 0 || (flags & ~7u)) return INVALID_VALUE;
    Allocation *a = new_page_locked_allocation(
        size, format("cuMemHostAlloc of %zu bytes (flags %u)", size, flags));
    if (a == nullptr) return OUT_OF_MEMORY;
    *pointer = reinterpret_cast<void *>(a->base);
    return SUCCESS;
}

FAKE_API int cuMemFreeHost(void *pointer) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuMemFreeHost")) return e;
    Allocation *a = find_allocation(uintptr_t(pointer), 0, MemoryKind::PageLocked);
    if (a == nullptr || a->base != uintptr_t(pointer))
        die(format("cuMemFreeHost(%p): not memory cuMemHostAlloc returned", pointer));
    if (a->freed) die(format("cuMemFreeHost of %s, freed before", a->describe().c_str()));
    for (auto &copy : st.pending_copies)
        if (copy->source == a)
            die(format("cuMemFreeHost of %s while %s, which reads it, is still pending (the "
                       "host has not learnt that it completed): free page-locked memory only "
                       "after an event recorded after the copy has completed",
                       a->describe().c_str(), copy->what.c_str()));
    a->freed = true;
    a->freed_by = "cuMemFreeHost";
    release_memory(a);
    return SUCCESS;
}

FAKE_API int cuMemsetD8Async(unsigned long long dst, unsigned char value, size_t n, void *stream) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuMemsetD8Async")) return e;
    if (int e = injected("cuMemsetD8Async")) return e;
    Allocation *a = device_allocation_at(dst, n, "cuMemsetD8Async");
    Stream *s = stream_of(stream, "cuMemsetD8Async");
    Op *op = new Op;
    op->stream = s;
    op->what = format("cuMemsetD8Async of %zu bytes on %s", n, s->describe().c_str());
    Clock clock = prepare(op);
    check_write(a, s->agent, op->seq, clock, op->what);
    op->run = [dst, value, n] { memset(reinterpret_cast<void *>(dst), value, n); };
    commit(op, clock);
    return SUCCESS;
}

FAKE_API int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, void *stream) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuMemcpyHtoDAsync_v2")) return e;
    if (int e = injected("cuMemcpyHtoDAsync_v2")) return e;
    if (n == 0) return SUCCESS;
    if (src == nullptr) return INVALID_VALUE;
    Allocation *a = device_allocation_at(dst, n, "cuMemcpyHtoDAsync_v2");
    Stream *s = stream_of(stream, "cuMemcpyHtoDAsync_v2");
    Op *op = new Op;
    op->stream = s;
    op->what = format("cuMemcpyHtoDAsync_v2 of %zu bytes on %s", n, s->describe().c_str());
    Clock clock = prepare(op);
    check_write(a, s->agent, op->seq, clock, op->what);
    Allocation *pinned = find_allocation(uintptr_t(src), n, MemoryKind::PageLocked);
    if (pinned == nullptr && find_allocation(uintptr_t(src), 0, MemoryKind::PageLocked))
        die(format("cuMemcpyHtoDAsync_v2 of %zu bytes from %p runs past the end of %s", n, src,
                   find_allocation(uintptr_t(src), 0, MemoryKind::PageLocked)->describe().c_str()));
    if (pinned != nullptr) {
        if (pinned->freed)
            die(format("%s reads %s after cuMemFreeHost freed it", op->what.c_str(),
                       pinned->describe().c_str()));
        // Read when the copy runs: the host must leave the bytes alone until it knows that
        // has happened.
        auto copy = std::make_shared<PendingCopy>();
        copy->source = pinned;
        copy->address = uintptr_t(src);
        copy->len = n;
        copy->checksum = checksum(src, n);
        copy->what = op->what;
        copy->enqueued_at_ms = now_ms();
        op->source = copy;
        op->run = [dst, src, n] { memcpy(reinterpret_cast<void *>(dst), src, n); };
    } else {
        // Pageable memory: the driver stages it before returning, as a real one does.
        auto staged = std::make_shared<std::vector<unsigned char>>(
            static_cast<const unsigned char *>(src), static_cast<const unsigned char *>(src) + n);
        op->run = [dst, staged] { memcpy(reinterpret_cast<void *>(dst), staged->data(), staged->size()); };
        st.pageable_async_copies++;
    }
    commit(op, clock);
    st.copies++;
    return SUCCESS;
}

FAKE_API int cuMemcpyDtoH_v2(void *dst, unsigned long long src, size_t n) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuMemcpyDtoH_v2")) return e;
    if (int e = injected("cuMemcpyDtoH_v2")) return e;
    if (n == 0) return SUCCESS;
    Allocation *a = device_allocation_at(src, n, "cuMemcpyDtoH_v2");
    // On the legacy default stream, and synchronous: it returns once the bytes are here.
    Stream *s = st.streams[NULL_STREAM].get();
    Op *op = new Op;
    op->stream = s;
    op->what = format("cuMemcpyDtoH_v2 of %zu bytes (legacy default stream)", n);
    Clock clock = prepare(op);
    check_read(a, s->agent, op->seq, clock, op->what);
    op->run = [dst, src, n] { memcpy(dst, reinterpret_cast<const void *>(src), n); };
    commit(op, clock);
    synchronize_stream(lock, s);
    st.copies++;
    return st.context.sticky_error;
}

// ---- streams and events ---------------------------------------------------------------------

FAKE_API int cuStreamCreate(void **stream, unsigned flags) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuStreamCreate")) return e;
    if (int e = injected("cuStreamCreate")) return e;
    if (stream == nullptr || flags > 1) return INVALID_VALUE;
    *stream = new_stream(flags);
    return SUCCESS;
}

FAKE_API int cuStreamDestroy_v2(void *stream) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuStreamDestroy_v2")) return e;
    if (stream == nullptr) return INVALID_HANDLE;
    Stream *s = stream_of(stream, "cuStreamDestroy_v2");
    // Work already queued still runs; the stream's thread ends after it.
    s->destroyed = true;
    st.progress.notify_all();
    return SUCCESS;
}

FAKE_API int cuStreamSynchronize(void *stream) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuStreamSynchronize")) return e;
    if (int e = injected("cuStreamSynchronize")) return e;
    st.stream_synchronizes++;
    synchronize_stream(lock, stream_of(stream, "cuStreamSynchronize"));
    return st.context.sticky_error;
}

FAKE_API int cuStreamQuery(void *stream) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuStreamQuery")) return e;
    Stream *s = stream_of(stream, "cuStreamQuery");
    if (s->completed < s->enqueued) return NOT_READY;
    host_learns(s->clock);
    return st.context.sticky_error;
}

FAKE_API int cuStreamWaitEvent(void *stream, void *event, unsigned flags) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuStreamWaitEvent")) return e;
    if (int e = injected("cuStreamWaitEvent")) return e;
    if (flags != 0) return INVALID_VALUE;
    Stream *s = stream_of(stream, "cuStreamWaitEvent");
    auto e = event_of(event, "cuStreamWaitEvent");
    if (!e->latest) return SUCCESS;  // never recorded: nothing to wait for
    // Waits for the work the event's last record captured (not for later records).
    Op *op = new Op;
    op->stream = s;
    op->what = format("cuStreamWaitEvent on %s", s->describe().c_str());
    op->after_records.push_back(e->latest);
    Clock clock = prepare(op);
    clock.join(e->latest->clock);
    commit(op, clock);
    return SUCCESS;
}

FAKE_API int cuEventCreate(void **event, unsigned flags) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuEventCreate")) return e;
    if (int e = injected("cuEventCreate")) return e;
    if (event == nullptr || (flags & ~7u)) return INVALID_VALUE;
    auto e = std::make_shared<Event>();
    e->flags = flags;
    st.events.push_back(e);
    *event = e.get();
    return SUCCESS;
}

FAKE_API int cuEventDestroy_v2(void *event) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuEventDestroy_v2")) return e;
    auto e = event_of(event, "cuEventDestroy_v2");
    if (int code = injected("cuEventDestroy_v2")) return code;
    // Waits already queued on it still complete (they hold it).
    e->destroyed = true;
    return SUCCESS;
}

FAKE_API int cuEventRecord(void *event, void *stream) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuEventRecord")) return e;
    if (int e = injected("cuEventRecord")) return e;
    auto e = event_of(event, "cuEventRecord");
    Stream *s = stream_of(stream, "cuEventRecord");
    Op *op = new Op;
    op->stream = s;
    op->what = format("cuEventRecord on %s", s->describe().c_str());
    Clock clock = prepare(op);
    e->latest = std::make_shared<EventRecord>();
    e->latest->clock = clock;
    op->records = e->latest;
    commit(op, clock);
    return SUCCESS;
}

FAKE_API int cuEventQuery(void *event) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuEventQuery")) return e;
    auto e = event_of(event, "cuEventQuery");
    if (!e->latest) return SUCCESS;
    if (!e->latest->done) return NOT_READY;
    host_learns(e->latest->clock);
    return st.context.sticky_error;
}

FAKE_API int cuEventSynchronize(void *event) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuEventSynchronize")) return e;
    if (int e = injected("cuEventSynchronize")) return e;
    auto e = event_of(event, "cuEventSynchronize");
    synchronize_event(lock, *e);
    return st.context.sticky_error;
}

FAKE_API int cuEventElapsedTime(float *ms, void *start, void *end) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuEventElapsedTime")) return e;
    auto a = event_of(start, "cuEventElapsedTime");
    auto b = event_of(end, "cuEventElapsedTime");
    if (ms == nullptr) return INVALID_VALUE;
    if ((a->flags | b->flags) & 2 /* CU_EVENT_DISABLE_TIMING */) return INVALID_HANDLE;
    if (!a->latest || !b->latest) return INVALID_HANDLE;
    if (!a->latest->done || !b->latest->done) return NOT_READY;
    *ms = float(b->latest->done_at_ms - a->latest->done_at_ms);
    return SUCCESS;
}

// ---- for tests ------------------------------------------------------------------------------

// What the fake holds and has done, for tests (a leak check, counters). `size` is the caller's
// sizeof, so a shorter struct from an older caller still works.
struct FakeCounts {
    uint64_t device_allocations_live;
    uint64_t page_locked_allocations_live;
    uint64_t streams_live;
    uint64_t events_live;
    uint64_t contexts_retained;
    uint64_t kernels_launched;
    uint64_t copies;
    uint64_t checked_accesses;
    uint64_t spinning_waits;
    uint64_t pageable_async_copies;
    uint64_t blas_calls;
    uint64_t stream_synchronizes;
};

FAKE_API int imagefeed_fake_cuda_counts(FakeCounts *out, size_t size) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    FakeCounts c{};
    for (auto &a : st.allocations) {
        if (a->freed) continue;
        (a->kind == MemoryKind::Device ? c.device_allocations_live : c.page_locked_allocations_live)++;
    }
    for (size_t i = NULL_STREAM + 1; i < st.streams.size(); i++) c.streams_live += !st.streams[i]->destroyed;
    for (auto &e : st.events) c.events_live += !e->destroyed;
    c.contexts_retained = uint64_t(st.context.retained);
    c.kernels_launched = st.kernels_launched;
    c.copies = st.copies;
    c.checked_accesses = st.checked_accesses;
    c.spinning_waits = st.spinning_waits;
    c.pageable_async_copies = st.pageable_async_copies;
    c.blas_calls = st.blas_calls;
    c.stream_synchronizes = st.stream_synchronizes;
    memcpy(out, &c, std::min(size, sizeof c));
    return 0;
}

// Sets a test's fault-injection rules (as IMAGEFEED_FAKE_CUDA_FAIL's, which stay in force
// beside them), replacing the test's earlier ones; calls are counted from now. Returns 0, or -1
// for a malformed spec. Also clears a sticky error, so a test can go on after injecting one.
FAKE_API int imagefeed_fake_cuda_inject(const char *spec) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    std::vector<Rule> parsed;
    if (spec != nullptr && !parse_rules(spec, parsed)) return -1;
    test_rules = parsed;
    st.context.sticky_error = 0;
    return 0;
}

// 1: this library is the fake (for tests that only make sense on it).
FAKE_API int imagefeed_fake_cuda_version() { return 1; }
