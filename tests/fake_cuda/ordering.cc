// Streams, events and the happens-before checks of the fake driver.
//
// Each operation is ordered, when it is enqueued, after: the operations before it on its stream,
// what the events its stream waited on (cuStreamWaitEvent) had recorded, and what the host had
// learnt by synchronizing. That is a vector clock per stream (and one for the host); an
// operation's clock says which operations of every stream happened before it. Every access to
// device memory is checked against the allocation's history with that clock when the operation
// is enqueued: a write must come after every earlier read and write, a read after the last
// write. The answer does not depend on when the stream threads happen to run the work, so a
// missing wait is found on every run, not on an unlucky one.
#include <algorithm>
#include <chrono>

#include "fake.h"

namespace fake {

std::string Stream::describe() const {
    if (agent == NULL_STREAM) return "the legacy default stream";
    return format("stream %d", agent - 1);
}

namespace {

bool ready(const Op *op) {
    for (auto &record : op->after_records)
        if (!record->done) return false;
    for (auto &[stream, seq] : op->after_streams)
        if (stream->completed < seq) return false;
    return true;
}

void verify(const PendingCopy &copy, const char *when) {
    uint64_t now = checksum(reinterpret_cast<const void *>(copy.address), copy.len);
    if (now == copy.checksum) return;
    die(format("%s was rewritten while a copy from it was pending (%s): %s was enqueued at "
               "%.3f ms, and at %.3f ms its %zu source bytes at 0x%lx differ from what they "
               "were then. The host must leave memory a copy reads alone until it has learnt "
               "(an event or a stream synchronized) that the copy completed.",
               copy.source->describe().c_str(), when, copy.what.c_str(), copy.enqueued_at_ms,
               now_ms(), copy.len, (unsigned long)copy.address));
}

void run_stream(Stream *s) {
    State &st = state();
    std::unique_lock<std::mutex> lock(st.mu);
    for (;;) {
        st.progress.wait(lock, [&] { return !s->queue.empty() || s->destroyed; });
        if (s->queue.empty()) return;  // destroyed, and its work done
        Op *op = s->queue.front();
        st.progress.wait(lock, [&] { return ready(op); });
        uint64_t delay = st.max_delay_us ? s->rng() % (st.max_delay_us + 1) : 0;
        bool skip = s->ctx->sticky_error != 0;
        lock.unlock();
        if (delay) std::this_thread::sleep_for(std::chrono::microseconds(delay));
        if (!skip) {
            if (op->source) verify(*op->source, "checked when the copy ran");
            if (op->run && !op->fails) {
                set_running(op->what.c_str());
                op->run();
                set_running(nullptr);
            }
        }
        lock.lock();
        if (st.trace) fprintf(stderr, "[fake cuda] ran %s\n", op->what.c_str());
        if (op->fails && !skip) s->ctx->sticky_error = LAUNCH_FAILED;
        if (op->records) {
            op->records->done = true;
            op->records->done_at_ms = now_ms();
        }
        if (op->frees) release_memory(op->frees);
        s->completed = op->seq;
        s->queue.pop_front();
        delete op;
        st.progress.notify_all();
    }
}

std::string unordered(const Allocation *a, const Access &first, const char *first_does,
                      const std::string &second, const char *second_does) {
    return format(
        "unordered accesses to %s: %s %s it, then %s %s it, and nothing orders the first "
        "before the second (no event recorded after the first was waited on by the second's "
        "stream, and the host had not synchronized with the first before enqueueing the "
        "second). On a GPU the two may run at the same time.",
        a->describe().c_str(), first.what.c_str(), first_does, second.c_str(), second_does);
}

}  // namespace

Stream *new_stream(unsigned flags) { return add_stream(state(), flags); }

Stream *add_stream(State &st, unsigned flags) {
    auto s = std::make_unique<Stream>();
    s->agent = Agent(st.streams.size());
    s->flags = flags;
    s->ctx = &st.context;
    s->rng.seed(st.seed * 0x9E3779B97F4A7C15ull + uint64_t(s->agent));
    Stream *out = s.get();
    st.streams.push_back(std::move(s));
    return out;
}

Stream *stream_of(void *handle, const char *call) {
    State &st = state();
    if (handle == nullptr) return st.streams[NULL_STREAM].get();
    for (auto &s : st.streams)
        if (s.get() == handle) {
            if (s->destroyed) die(format("%s on %s, which was destroyed", call, s->describe().c_str()));
            return s.get();
        }
    die(format("%s on an unknown stream handle %p", call, handle));
}

std::shared_ptr<Event> event_of(void *handle, const char *call) {
    for (auto &e : state().events)
        if (e.get() == handle) {
            if (e->destroyed) die(format("%s on an event that was destroyed", call));
            return e;
        }
    die(format("%s on an unknown event handle %p", call, handle));
}

Clock prepare(Op *op) {
    State &st = state();
    Stream *s = op->stream;
    Clock clock = s->clock;
    if (s->agent == NULL_STREAM) {
        // The legacy default stream waits for every blocking stream's work.
        for (size_t i = NULL_STREAM + 1; i < st.streams.size(); i++) {
            Stream *b = st.streams[i].get();
            if (b->flags != 0 || b->destroyed) continue;
            op->after_streams.push_back({b, b->enqueued});
            clock.join(b->clock);
        }
    } else if (s->flags == 0) {
        // A blocking stream waits for the legacy default stream's work.
        Stream *n = st.streams[NULL_STREAM].get();
        op->after_streams.push_back({n, n->enqueued});
        clock.join(n->clock);
    }
    clock.join(st.host);
    op->seq = s->enqueued + 1;
    clock.set(s->agent, op->seq);
    op->enqueued_at_ms = now_ms();
    // Any page-locked source a pending copy reads must still hold what it held then.
    verify_pending_copies("checked at a later call");
    return clock;
}

void commit(Op *op, const Clock &clock) {
    State &st = state();
    Stream *s = op->stream;
    s->clock = clock;
    s->enqueued = op->seq;
    s->queue.push_back(op);
    if (op->source) {
        op->source->agent = s->agent;
        op->source->seq = op->seq;
        st.pending_copies.push_back(op->source);
        protect_source(op->source->address, op->source->len);
    }
    if (st.trace) fprintf(stderr, "[fake cuda] enqueued %s\n", op->what.c_str());
    if (!s->started) {
        s->started = true;
        std::thread(run_stream, s).detach();
    }
    st.progress.notify_all();
}

void check_read(Allocation *a, Agent agent, uint64_t tick, const Clock &clock,
                const std::string &what) {
    state().checked_accesses++;
    if (a->freed)
        die(format("%s reads %s after %s freed it", what.c_str(), a->describe().c_str(),
                   a->freed_by.c_str()));
    if (!a->last_write.before(clock)) die(unordered(a, a->last_write, "writes", what, "reads"));
    for (auto &r : a->reads)
        if (r.agent == agent) {
            r.tick = tick;
            r.what = what;
            return;
        }
    a->reads.push_back(Access{agent, tick, what});
}

void check_write(Allocation *a, Agent agent, uint64_t tick, const Clock &clock,
                 const std::string &what) {
    state().checked_accesses++;
    if (a->freed)
        die(format("%s writes %s after %s freed it", what.c_str(), a->describe().c_str(),
                   a->freed_by.c_str()));
    if (!a->last_write.before(clock)) die(unordered(a, a->last_write, "writes", what, "writes"));
    for (auto &r : a->reads)
        if (!r.before(clock)) die(unordered(a, r, "reads", what, "writes"));
    a->last_write = Access{agent, tick, what};
    a->reads.clear();
}

void synchronize_stream(std::unique_lock<std::mutex> &lock, Stream *s) {
    State &st = state();
    uint64_t target = s->enqueued;
    Clock clock = s->clock;
    st.progress.wait(lock, [&] { return s->completed >= target; });
    host_learns(clock);
}

void synchronize_event(std::unique_lock<std::mutex> &lock, Event &e) {
    State &st = state();
    if (!(e.flags & 1 /* CU_EVENT_BLOCKING_SYNC */)) st.spinning_waits++;
    auto record = e.latest;
    if (!record) return;  // never recorded: nothing to wait for
    st.progress.wait(lock, [&] { return record->done; });
    host_learns(record->clock);
}

void host_learns(const Clock &clock) {
    State &st = state();
    st.host.join(clock);
    auto &pending = st.pending_copies;
    for (auto it = pending.begin(); it != pending.end();) {
        PendingCopy &copy = **it;
        if (st.host.at(copy.agent) < copy.seq) {
            ++it;
            continue;
        }
        verify(copy, "checked when the host learnt the copy was done");
        unprotect_source(copy.address, copy.len);
        it = pending.erase(it);
    }
}

void verify_pending_copies(const char *when) {
    for (auto &copy : state().pending_copies) verify(*copy, when);
}

}  // namespace fake
