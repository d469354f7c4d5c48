// imagefeed's fake CUDA driver: the state every part shares.
//
// A stand-in for libcuda.so (and the four cuBLAS calls of the training example) that runs the
// GPU feed on a machine without a GPU and checks the ordering rules a real GPU would punish
// only sometimes. What it is and is not is in docs/gpu.md ("Without a GPU"); in short:
//
// - device memory is host memory: each allocation its own mapping between guard pages, never
//   reused, made inaccessible when freed;
// - each stream is a thread that runs its queued work later, after a seeded random delay;
//   events have generations; waits are honoured; synchronous calls really wait;
// - every access to device memory is checked against the happens-before order the program
//   established (vector clocks: streams, events, host synchronization) when it is enqueued, so
//   a missing wait is found deterministically, whatever the timing; page-locked host memory a
//   pending copy reads is checksummed when the copy is enqueued and again when it runs;
// - kernels run on the host, compiled from the same .cu sources as the shipped PTX, and are
//   found by name; their parameter lists are checked against the PTX's;
// - chosen calls can be made to fail (fault injection).
//
// A broken rule aborts the process with a message saying which rule, which calls and which
// memory: tests run what may break in a child process.
//
// Layout: fake.h (this), driver.cc (entry points, contexts, faults), memory.cc (allocations,
// guard pages, the fault handler), ordering.cc (streams, events, happens-before checks),
// kernels.cc (host kernels, PTX parameters, launches), cublas.cc (SGEMM).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#define FAKE_API extern "C" __attribute__((visibility("default")))

namespace fake {

// The driver's result codes this fake returns (values from cuda.h).
enum Result : int {
    SUCCESS = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    STUB_LIBRARY = 34,
    NO_DEVICE = 100,
    INVALID_DEVICE = 101,
    INVALID_IMAGE = 200,
    INVALID_CONTEXT = 201,
    INVALID_PTX = 218,
    INVALID_HANDLE = 400,
    NOT_FOUND = 500,
    NOT_READY = 600,
    ILLEGAL_ADDRESS = 700,
    LAUNCH_FAILED = 719,
};

const char *result_name(int code);

// Aborts the process with "imagefeed fake CUDA: <message>" on stderr.
[[noreturn]] void die(const std::string &message);
std::string format(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

// ---- happens-before -------------------------------------------------------------------------

// Agent 0 is the host (what host synchronization has learnt), 1 the legacy default stream,
// 2.. the streams the program created.
using Agent = int;
constexpr Agent HOST = 0;
constexpr Agent NULL_STREAM = 1;

// A vector clock: for each agent, the last of its operations known to have happened before.
struct Clock {
    std::vector<uint64_t> ticks;
    uint64_t at(Agent a) const { return size_t(a) < ticks.size() ? ticks[a] : 0; }
    void set(Agent a, uint64_t t) {
        if (ticks.size() <= size_t(a)) ticks.resize(a + 1, 0);
        ticks[a] = t;
    }
    void join(const Clock &other) {
        if (ticks.size() < other.ticks.size()) ticks.resize(other.ticks.size(), 0);
        for (size_t i = 0; i < other.ticks.size(); i++)
            if (other.ticks[i] > ticks[i]) ticks[i] = other.ticks[i];
    }
};

// One access to memory by an operation: (agent, tick) orders it; `what` names it.
struct Access {
    Agent agent = -1;
    uint64_t tick = 0;
    std::string what;
    bool known() const { return agent >= 0; }
    bool before(const Clock &clock) const { return !known() || clock.at(agent) >= tick; }
};

// ---- memory ---------------------------------------------------------------------------------

enum class MemoryKind { Device, PageLocked };

struct Allocation;

// A copy from page-locked memory, from its enqueueing until the host has learnt (by a
// synchronization, or an event query) that it completed: until then the host must not write
// the bytes it reads. They are checksummed when it is enqueued and checked at every later call,
// when it runs and when the host learns it is done; their pages are read-only meanwhile, so a
// host write faults at once.
struct PendingCopy {
    Allocation *source = nullptr;
    uintptr_t address = 0;
    size_t len = 0;
    uint64_t checksum = 0;
    Agent agent = 0;  // the copy's stream, and its position there
    uint64_t seq = 0;
    std::string what;
    double enqueued_at_ms = 0;
};

struct Allocation {
    uint64_t id = 0;
    MemoryKind kind = MemoryKind::Device;
    uintptr_t base = 0;  // what the program sees: a device address, or a host pointer
    size_t size = 0;
    uintptr_t map = 0;  // the mapping behind it (guard pages included)
    size_t map_len = 0;
    std::string made_by;
    bool freed = false;
    std::string freed_by;
    // Device memory: the last write, and the reads since it (one per agent).
    Access last_write;
    std::vector<Access> reads;
    std::string describe() const;
};

// The allocation holding [address, address + len), live or freed; nullptr when none does.
Allocation *find_allocation(uintptr_t address, size_t len, MemoryKind kind);
Allocation *new_device_allocation(size_t size, const std::string &made_by);
Allocation *new_page_locked_allocation(size_t size, const std::string &made_by);
// Makes a freed allocation's memory inaccessible (its addresses stay reserved, never reused).
void release_memory(Allocation *a);
// Makes the pages under [address, address + len) read-only while a copy reads them (counted:
// the last of overlapping copies to finish makes them writable again).
void protect_source(uintptr_t address, size_t len);
void unprotect_source(uintptr_t address, size_t len);
void install_fault_handler();
// Names what the calling (stream) thread runs, for the fault handler's message.
void set_running(const char *what);
uint64_t checksum(const void *data, size_t len);

// ---- streams, events, operations ------------------------------------------------------------

struct Context;

// One cuEventRecord: what it is ordered after, and whether its stream has reached it. A wait
// holds the record it saw, so recording the event again (on any stream) changes nothing for it.
struct EventRecord {
    Clock clock;
    bool done = false;
    double done_at_ms = 0;
};

struct Event {
    unsigned flags = 0;
    std::shared_ptr<EventRecord> latest;  // nullptr: never recorded
    bool destroyed = false;
};

struct Stream;

// Something queued on a stream.
struct Op {
    Stream *stream = nullptr;
    uint64_t seq = 0;  // position in its stream
    std::string what;
    // What must be done before the op may start: event records, and (stream, seq) pairs.
    std::vector<std::shared_ptr<EventRecord>> after_records;
    std::vector<std::pair<Stream *, uint64_t>> after_streams;
    // The work, run on the stream's thread without the lock held.
    std::function<void()> run;
    // The event record this op completes.
    std::shared_ptr<EventRecord> records;
    // A copy from page-locked memory.
    std::shared_ptr<PendingCopy> source;
    // Memory this op frees when it runs.
    Allocation *frees = nullptr;
    // A kernel that fails while it runs (injected): the context's error becomes sticky.
    bool fails = false;
    double enqueued_at_ms = 0;
};

struct Stream {
    Agent agent = 0;
    unsigned flags = 0;
    Context *ctx = nullptr;
    Clock clock;  // what the next op enqueued is ordered after
    uint64_t enqueued = 0, completed = 0;
    std::deque<Op *> queue;
    bool started = false, destroyed = false;
    std::mt19937_64 rng;
    std::string describe() const;
};

struct Context {
    int device = 0;
    int retained = 0;
    int sticky_error = 0;  // a failed launch: every later call fails with it
};

// Everything, behind one lock. Never destroyed: stream threads may outlive static destructors.
struct State {
    std::mutex mu;
    std::condition_variable progress;
    bool initialized = false;
    Context context;  // the one device's primary context
    std::vector<std::unique_ptr<Stream>> streams;  // index = agent; [0] unused, [1] null stream
    std::vector<std::shared_ptr<Event>> events;
    std::vector<std::unique_ptr<Allocation>> allocations;
    Clock host;  // what the host has learnt by synchronizing
    // Copies from page-locked memory the host has not yet learnt are done.
    std::vector<std::shared_ptr<PendingCopy>> pending_copies;
    uint64_t seed = 1;
    uint64_t max_delay_us = 200;
    bool trace = false;
    // Counters (imagefeed_fake_cuda_counts).
    uint64_t kernels_launched = 0, copies = 0, checked_accesses = 0, spinning_waits = 0,
             pageable_async_copies = 0, blas_calls = 0, stream_synchronizes = 0;
};

State &state();
// Monotonic milliseconds since the process started using the fake.
double now_ms();

// The calling thread's current context (nullptr: none).
Context *current_context();
// Aborts when the calling thread has no current context; returns the context's sticky error.
int require_context(const char *call);

Stream *stream_of(void *handle, const char *call);  // handle 0 is the legacy default stream
std::shared_ptr<Event> event_of(void *handle, const char *call);
Stream *new_stream(unsigned flags);
// The same, for use before state() can be called (initialization).
Stream *add_stream(State &st, unsigned flags);
// Gives `op` (its stream set) its tick and the clock it is ordered after (its own tick
// included), without queueing it: check its accesses with that clock, then commit it.
Clock prepare(Op *op);
// Queues a prepared op (lock held), starting its stream's thread on first use.
void commit(Op *op, const Clock &clock);
// Checks an access by an op with clock `clock` (agent, tick = its own) and records it.
void check_read(Allocation *a, Agent agent, uint64_t tick, const Clock &clock,
                const std::string &what);
void check_write(Allocation *a, Agent agent, uint64_t tick, const Clock &clock,
                 const std::string &what);
// Waits (lock held) until every op queued on `s` so far has run; the host learns its clock.
void synchronize_stream(std::unique_lock<std::mutex> &lock, Stream *s);
void synchronize_event(std::unique_lock<std::mutex> &lock, Event &e);
// The host has learnt that what `clock` covers is done: copies from page-locked memory it
// covers are checked a last time and no longer pending.
void host_learns(const Clock &clock);
// Checks that no pending copy's page-locked source was rewritten (`when`: for the message).
void verify_pending_copies(const char *when);

// ---- faults ---------------------------------------------------------------------------------

// 0, or the error the named call must fail with this time, from IMAGEFEED_FAKE_CUDA_FAIL and
// the rules a test set with imagefeed_fake_cuda_inject ("NAME[@N][=CODE|=sticky],..."); -1 for
// a launch that fails while it runs (a sticky error).
int injected(const char *call);

}  // namespace fake
