// Device and page-locked memory of the fake driver.
//
// Every allocation is its own mapping: a guard page, the bytes (ending exactly where the second
// guard page starts), that guard page. Freed memory is made inaccessible and its addresses stay
// reserved, so no later allocation reuses them: a read even one byte past an end, or after a
// free, faults at once, and the fault handler says which allocation it hit and what was running.
// (An underrun faults only once it leaves the first page. Addresses are aligned to the size's
// own alignment, not CUDA's 256 bytes: code relying on more alignment is not caught here.)
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

#include "fake.h"

namespace fake {

namespace {

size_t page_size() {
    static size_t size = size_t(sysconf(_SC_PAGESIZE));
    return size;
}

// What the fault handler may read without a lock: address ranges and what they are. Entries
// are only appended (and their `freed` flag set), never removed.
struct Region {
    std::atomic<uintptr_t> start{0}, end{0};  // the whole mapping
    std::atomic<uintptr_t> data{0}, data_end{0};
    std::atomic<uint64_t> id{0};
    std::atomic<int> kind{0};  // MemoryKind
    std::atomic<bool> freed{false};
};
constexpr size_t MAX_REGIONS = 1 << 16;
Region regions[MAX_REGIONS];
std::atomic<size_t> region_count{0};

Region *add_region(const Allocation &a) {
    size_t i = region_count.fetch_add(1);
    if (i >= MAX_REGIONS) die("more than 65536 allocations in one process");
    Region &r = regions[i];
    r.start = a.map;
    r.end = a.map + a.map_len;
    r.data = a.base;
    r.data_end = a.base + a.size;
    r.id = a.id;
    r.kind = int(a.kind);
    return &r;
}

Allocation *new_allocation(MemoryKind kind, size_t size, const std::string &made_by) {
    State &s = state();
    size_t page = page_size();
    size_t data_pages = (size + page - 1) / page;
    if (data_pages == 0) data_pages = 1;
    size_t len = (data_pages + 2) * page;
    void *map = mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (map == MAP_FAILED) return nullptr;
    uintptr_t rw = uintptr_t(map) + page;
    if (mprotect(reinterpret_cast<void *>(rw), data_pages * page, PROT_READ | PROT_WRITE) != 0) {
        munmap(map, len);
        return nullptr;
    }
    auto a = std::make_unique<Allocation>();
    a->id = s.allocations.size() + 1;
    a->kind = kind;
    a->map = uintptr_t(map);
    a->map_len = len;
    a->base = rw + data_pages * page - size;
    a->size = size;
    a->made_by = made_by;
    // Fresh device memory holds garbage on a GPU: make it visible garbage.
    if (kind == MemoryKind::Device) std::memset(reinterpret_cast<void *>(a->base), 0xA5, size);
    Allocation *out = a.get();
    s.allocations.push_back(std::move(a));
    add_region(*out);
    return out;
}

void write_text(const char *text) {
    size_t n = strlen(text);
    while (n > 0) {
        ssize_t w = write(2, text, n);
        if (w <= 0) return;
        text += w;
        n -= size_t(w);
    }
}

void write_number(uint64_t v, int base) {
    char buf[32];
    int i = 31;
    buf[i] = 0;
    do {
        buf[--i] = "0123456789abcdef"[v % base];
        v /= base;
    } while (v && i > 0);
    write_text(buf + i);
}

struct sigaction previous_segv, previous_bus;

// The kernel or copy running on this thread, for the fault message (initial-exec: read from the
// signal handler, it must not allocate on first use).
thread_local const char *running_now __attribute__((tls_model("initial-exec"))) = nullptr;

// Pages made read-only under pending copies, and how many copies hold each.
std::vector<std::pair<uintptr_t, int>> protected_pages;

void on_fault(int sig, siginfo_t *info, void *context) {
    uintptr_t address = uintptr_t(info->si_addr);
    size_t n = region_count.load();
    if (n > MAX_REGIONS) n = MAX_REGIONS;
    for (size_t i = 0; i < n; i++) {
        Region &r = regions[i];
        if (address < r.start || address >= r.end) continue;
        write_text("imagefeed fake CUDA: ");
        bool in_data = address >= r.data && address < r.data_end;
        if (in_data && !r.freed && r.kind == int(MemoryKind::PageLocked)) {
            write_text("the host wrote page-locked allocation #");
            write_number(r.id, 10);
            write_text(" at address 0x");
            write_number(address, 16);
            write_text(" while a copy from it was pending (the host had not learnt, by an event "
                       "or a synchronization, that the copy completed)\n");
            signal(SIGABRT, SIG_DFL);
            abort();
        }
        write_text(running_now ? running_now : "the host");
        if (r.freed) {
            write_text(" touched freed ");
        } else {
            write_text(address < r.data ? " touched memory before the start of "
                                         : " touched memory past the end of ");
        }
        write_text(r.kind == int(MemoryKind::Device) ? "device allocation #"
                                                     : "page-locked allocation #");
        write_number(r.id, 10);
        write_text(" (");
        write_number(r.data_end - r.data, 10);
        write_text(" bytes at 0x");
        write_number(r.data, 16);
        write_text(") at address 0x");
        write_number(address, 16);
        write_text("\n");
        signal(SIGABRT, SIG_DFL);
        abort();
    }
    // Not ours: whoever handled it before (Rust's stack-overflow guard, or the default).
    struct sigaction &prev = sig == SIGBUS ? previous_bus : previous_segv;
    if (prev.sa_flags & SA_SIGINFO) {
        prev.sa_sigaction(sig, info, context);
    } else if (prev.sa_handler == SIG_DFL || prev.sa_handler == SIG_IGN) {
        signal(sig, SIG_DFL);  // returning re-runs the access, which now kills as it would have
    } else {
        prev.sa_handler(sig);
    }
}

}  // namespace

std::string Allocation::describe() const {
    return format("%s allocation #%llu (%zu bytes at 0x%lx, made by %s)",
                  kind == MemoryKind::Device ? "device" : "page-locked",
                  (unsigned long long)id, size, (unsigned long)base, made_by.c_str());
}

Allocation *find_allocation(uintptr_t address, size_t len, MemoryKind kind) {
    for (auto &a : state().allocations) {
        if (a->kind != kind) continue;
        if (address >= a->base && address < a->base + (a->size ? a->size : 1)) {
            if (len > a->size - (address - a->base)) return nullptr;
            return a.get();
        }
    }
    return nullptr;
}

Allocation *new_device_allocation(size_t size, const std::string &made_by) {
    return new_allocation(MemoryKind::Device, size, made_by);
}

Allocation *new_page_locked_allocation(size_t size, const std::string &made_by) {
    return new_allocation(MemoryKind::PageLocked, size, made_by);
}

void release_memory(Allocation *a) {
    for (size_t i = 0; i < region_count.load() && i < MAX_REGIONS; i++) {
        if (regions[i].id == a->id && regions[i].start == a->map) regions[i].freed = true;
    }
    // Poisoned, then unreadable; the pages go back to the system, the addresses stay taken.
    std::memset(reinterpret_cast<void *>(a->base), 0xDD, a->size);
    mprotect(reinterpret_cast<void *>(a->map), a->map_len, PROT_NONE);
    madvise(reinterpret_cast<void *>(a->map), a->map_len, MADV_DONTNEED);
}

namespace {

template <typename F>
void each_page(uintptr_t address, size_t len, F f) {
    size_t page = page_size();
    if (len == 0) return;
    for (uintptr_t p = address / page * page; p < address + len; p += page) f(p);
}

}  // namespace

void protect_source(uintptr_t address, size_t len) {
    each_page(address, len, [](uintptr_t p) {
        for (auto &entry : protected_pages)
            if (entry.first == p) {
                entry.second++;
                return;
            }
        protected_pages.push_back({p, 1});
        mprotect(reinterpret_cast<void *>(p), page_size(), PROT_READ);
    });
}

void unprotect_source(uintptr_t address, size_t len) {
    each_page(address, len, [](uintptr_t p) {
        for (auto it = protected_pages.begin(); it != protected_pages.end(); ++it)
            if (it->first == p) {
                if (--it->second == 0) {
                    mprotect(reinterpret_cast<void *>(p), page_size(), PROT_READ | PROT_WRITE);
                    protected_pages.erase(it);
                }
                return;
            }
    });
}

void install_fault_handler() {
    static std::once_flag once;
    std::call_once(once, [] {
        struct sigaction action;
        std::memset(&action, 0, sizeof action);
        action.sa_sigaction = on_fault;
        action.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&action.sa_mask);
        sigaction(SIGSEGV, &action, &previous_segv);
        sigaction(SIGBUS, &action, &previous_bus);
    });
}

// Names what the calling (stream) thread runs, for the fault handler.
void set_running(const char *what) { running_now = what; }

uint64_t checksum(const void *data, size_t len) {
    // FNV-1a over 8-byte words, then the tail: enough to see a rewrite.
    const unsigned char *p = static_cast<const unsigned char *>(data);
    uint64_t h = 0xcbf29ce484222325ull;
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        std::memcpy(&w, p + i, 8);
        h = (h ^ w) * 0x100000001b3ull;
    }
    for (; i < len; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

}  // namespace fake
