// Modules and kernel launches of the fake driver: the kernels run on the host, compiled from the
// same .cu sources as the shipped PTX (included below), found by name. Loading a module checks
// each PTX entry's parameter sizes against the host kernel's signature, so a PTX file that no
// longer matches its source is caught; a launch checks that every pointer argument is in a live
// device allocation and that its accesses are ordered (const pointers are read, others read and
// written).
#include <cstring>
#include <utility>

#include "fake.h"
#include "host_shim.h"

thread_local fake_dim3 threadIdx, blockIdx, blockDim, gridDim;

// The sources the shipped PTX files were compiled from.
#include "examples/train_cifar_gpu.cu"
#include "src/gpu/kernels.cu"

namespace fake {

namespace {

enum class Role { Value, Reads, ReadsWrites };

struct HostKernel {
    const char *name;
    std::vector<size_t> sizes;
    std::vector<Role> roles;
    void (*call)(void *const *args);
};

template <typename T>
Role role_of() {
    if constexpr (std::is_pointer_v<T>)
        return std::is_const_v<std::remove_pointer_t<T>> ? Role::Reads : Role::ReadsWrites;
    return Role::Value;
}

template <typename... A, size_t... I>
void invoke_with(void (*f)(A...), void *const *args, std::index_sequence<I...>) {
    f(*static_cast<A *>(args[I])...);
}

template <typename... A>
void invoke(void (*f)(A...), void *const *args) {
    invoke_with(f, args, std::index_sequence_for<A...>{});
}

template <typename... A>
HostKernel describe(const char *name, void (*)(A...), void (*call)(void *const *)) {
    return HostKernel{name, {sizeof(A)...}, {role_of<A>()...}, call};
}

#define KERNEL(fn) describe(#fn, &fn, [](void *const *args) { invoke(&fn, args); })

const std::vector<HostKernel> &host_kernels() {
    static const std::vector<HostKernel> kernels = {
        KERNEL(u8_nhwc_to_f32), KERNEL(u8_nhwc_to_f16), KERNEL(softmax_xent),
        KERNEL(column_sums),    KERNEL(add_bias),       KERNEL(sgd_step),
    };
    return kernels;
}

struct PtxEntry {
    std::string name;
    std::vector<size_t> sizes;
};

struct Module {
    std::vector<PtxEntry> entries;
    bool unloaded = false;
};

struct Function {
    Module *module;
    const PtxEntry *entry;
    const HostKernel *host;  // nullptr: no host version of this kernel
};

std::vector<std::unique_ptr<Module>> modules;
std::vector<std::unique_ptr<Function>> functions;

size_t type_size(const std::string &type) {
    static const std::pair<const char *, size_t> sizes[] = {
        {".u8", 1},  {".s8", 1},  {".b8", 1},  {".u16", 2}, {".s16", 2}, {".b16", 2},
        {".f16", 2}, {".u32", 4}, {".s32", 4}, {".b32", 4}, {".f32", 4}, {".u64", 8},
        {".s64", 8}, {".b64", 8}, {".f64", 8},
    };
    for (auto &[name, size] : sizes)
        if (type == name) return size;
    return 0;
}

// One `.param` declaration's size: `.param .u32 name`, or `.param .align 8 .b8 name[16]`.
size_t param_size(const std::string &decl) {
    std::vector<std::string> words;
    size_t i = 0;
    while (i < decl.size()) {
        while (i < decl.size() && isspace((unsigned char)decl[i])) i++;
        size_t start = i;
        while (i < decl.size() && !isspace((unsigned char)decl[i])) i++;
        if (i > start) words.push_back(decl.substr(start, i - start));
    }
    size_t element = 0;
    for (auto &w : words)
        if (size_t s = type_size(w)) element = s;
    if (element == 0 || words.empty()) return 0;
    const std::string &last = words.back();
    size_t open = last.find('[');
    if (open == std::string::npos) return element;
    return element * size_t(strtoull(last.c_str() + open + 1, nullptr, 10));
}

// The `.entry` declarations of a PTX text; false when it is not PTX.
bool parse_ptx(const char *text, std::vector<PtxEntry> &out) {
    std::string ptx(text);
    if (ptx.find(".version") == std::string::npos || ptx.find(".target") == std::string::npos)
        return false;
    size_t at = 0;
    while ((at = ptx.find(".entry", at)) != std::string::npos) {
        at += 6;
        size_t open = ptx.find('(', at);
        if (open == std::string::npos) return false;
        size_t close = ptx.find(')', open);
        if (close == std::string::npos) return false;
        PtxEntry entry;
        size_t b = at, e = open;
        while (b < e && isspace((unsigned char)ptx[b])) b++;
        while (e > b && isspace((unsigned char)ptx[e - 1])) e--;
        entry.name = ptx.substr(b, e - b);
        std::string params = ptx.substr(open + 1, close - open - 1);
        size_t p = 0;
        while (p < params.size()) {
            size_t comma = params.find(',', p);
            if (comma == std::string::npos) comma = params.size();
            std::string decl = params.substr(p, comma - p);
            if (decl.find(".param") != std::string::npos) {
                size_t size = param_size(decl);
                if (size == 0) return false;
                entry.sizes.push_back(size);
            }
            p = comma + 1;
        }
        out.push_back(std::move(entry));
        at = close;
    }
    return true;
}

std::string sizes_text(const std::vector<size_t> &sizes) {
    std::string out = "[";
    for (size_t i = 0; i < sizes.size(); i++) out += (i ? ", " : "") + std::to_string(sizes[i]);
    return out + "]";
}

Function *function_of(void *handle, const char *call) {
    for (auto &f : functions)
        if (f.get() == handle) {
            if (f->module->unloaded)
                die(format("%s with kernel %s, whose module was unloaded", call,
                           f->entry->name.c_str()));
            return f.get();
        }
    die(format("%s with an unknown function handle %p", call, handle));
}

}  // namespace

}  // namespace fake

using namespace fake;

FAKE_API int cuModuleLoadData(void **module, const void *image) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuModuleLoadData")) return e;
    if (int e = injected("cuModuleLoadData")) return e;
    if (module == nullptr || image == nullptr) return INVALID_VALUE;
    auto m = std::make_unique<Module>();
    if (!parse_ptx(static_cast<const char *>(image), m->entries)) return INVALID_PTX;
    for (auto &entry : m->entries) {
        for (auto &host : host_kernels()) {
            if (entry.name != host.name) continue;
            if (entry.sizes != host.sizes)
                die(format("the PTX entry %s declares parameters of sizes %s bytes, but the "
                           "kernel %s compiled from its .cu source takes %s: the PTX is stale "
                           "(run scripts/make_ptx.py)",
                           entry.name.c_str(), sizes_text(entry.sizes).c_str(), host.name,
                           sizes_text(host.sizes).c_str()));
        }
    }
    *module = m.get();
    modules.push_back(std::move(m));
    return SUCCESS;
}

FAKE_API int cuModuleUnload(void *module) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuModuleUnload")) return e;
    for (auto &m : modules)
        if (m.get() == module) {
            if (m->unloaded) die("cuModuleUnload of a module already unloaded");
            m->unloaded = true;
            return SUCCESS;
        }
    die(format("cuModuleUnload of an unknown module handle %p", module));
}

FAKE_API int cuModuleGetFunction(void **function, void *module, const char *name) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuModuleGetFunction")) return e;
    Module *m = nullptr;
    for (auto &candidate : modules)
        if (candidate.get() == module) m = candidate.get();
    if (m == nullptr) die(format("cuModuleGetFunction on an unknown module handle %p", module));
    if (m->unloaded) die("cuModuleGetFunction on a module that was unloaded");
    for (auto &entry : m->entries) {
        if (entry.name != name) continue;
        const HostKernel *host = nullptr;
        for (auto &k : host_kernels())
            if (entry.name == k.name) host = &k;
        functions.push_back(std::make_unique<Function>(Function{m, &entry, host}));
        *function = functions.back().get();
        return SUCCESS;
    }
    return NOT_FOUND;
}

FAKE_API int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                            unsigned by, unsigned bz, unsigned shared_bytes, void *stream,
                            void **params, void **extra) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    if (int e = require_context("cuLaunchKernel")) return e;
    int fault = injected("cuLaunchKernel");
    if (fault > 0) return fault;
    Function *fn = function_of(f, "cuLaunchKernel");
    const std::string &name = fn->entry->name;
    if (fn->host == nullptr)
        die(format("kernel %s has no host version in the fake driver (tests/fake_cuda/kernels.cc "
                   "lists the kernels it runs)",
                   name.c_str()));
    if (extra != nullptr) die("cuLaunchKernel's `extra` parameters are not supported by the fake");
    if (params == nullptr && !fn->host->sizes.empty())
        die(format("cuLaunchKernel of %s without parameters; it takes %zu", name.c_str(),
                   fn->host->sizes.size()));
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 ||
        uint64_t(bx) * by * bz > 1024 || gy > 65535 || gz > 65535)
        return INVALID_VALUE;
    (void)shared_bytes;
    Stream *s = stream_of(stream, "cuLaunchKernel");
    // The arguments are read now (the caller's storage may be gone once this returns).
    const HostKernel &k = *fn->host;
    auto storage = std::make_shared<std::vector<std::vector<uint64_t>>>();
    for (size_t i = 0; i < k.sizes.size(); i++) {
        storage->emplace_back((k.sizes[i] + 7) / 8);
        std::memcpy(storage->back().data(), params[i], k.sizes[i]);
    }
    Op *op = new Op;
    op->stream = s;
    op->what = format("kernel %s launched on %s", name.c_str(), s->describe().c_str());
    Clock clock = prepare(op);
    for (size_t i = 0; i < k.sizes.size(); i++) {
        if (k.roles[i] == Role::Value) continue;
        uintptr_t address = uintptr_t((*storage)[i][0]);
        Allocation *a = find_allocation(address, 1, MemoryKind::Device);
        if (a == nullptr)
            die(format("argument %zu of kernel %s is 0x%lx, which is in no device allocation: a "
                       "wrong address, or an argument before it of the wrong size (the PTX "
                       "declares sizes %s)",
                       i, name.c_str(), (unsigned long)address, sizes_text(k.sizes).c_str()));
        std::string what = format("%s (argument %zu)", op->what.c_str(), i);
        if (k.roles[i] == Role::Reads)
            check_read(a, s->agent, op->seq, clock, what);
        else
            check_write(a, s->agent, op->seq, clock, what);
    }
    op->fails = fault < 0;
    auto call = k.call;
    op->run = [storage, call, gx, gy, gz, bx, by, bz] {
        std::vector<void *> args;
        for (auto &a : *storage) args.push_back(a.data());
        gridDim = {gx, gy, gz};
        blockDim = {bx, by, bz};
        for (unsigned z = 0; z < gz; z++)
            for (unsigned y = 0; y < gy; y++)
                for (unsigned x = 0; x < gx; x++) {
                    blockIdx = {x, y, z};
                    for (unsigned tz = 0; tz < bz; tz++)
                        for (unsigned ty = 0; ty < by; ty++)
                            for (unsigned tx = 0; tx < bx; tx++) {
                                threadIdx = {tx, ty, tz};
                                call(args.data());
                            }
                }
    };
    commit(op, clock);
    st.kernels_launched++;
    return SUCCESS;
}
