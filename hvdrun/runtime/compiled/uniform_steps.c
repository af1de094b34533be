/* The steady state's exchange across hosts in one call: every step of a recursive doubling of a *uniform* value
 * ("ranks lo..hi all announced cached request number key alone; here is their data reduced"), with the GIL released.
 *
 * The wire format is the pure-Python path's, byte for byte (hvdrun/runtime/announcements.py, Uniform and HeldRange,
 * and hvdrun/runtime/collectives/streams.py, swap_small): a frame is an 8-byte little-endian length, then the
 * message padded to 8 bytes; a uniform message is a 32-byte header (a tag byte, 7 zero bytes, then key, lo, hi as
 * int64) and the data, which the steps reduce (a lone op's data) or require to be equal (op SAME: a held range's
 * numbers). So a rank on this path and a rank on the Python path are partners like any two.
 *
 * A step sends this rank's frame and receives the partner's, never reading past the partner's frame (its next one
 * may follow on the same socket), and then, by its mode: merges the partner's value with this rank's (this rank's
 * range above or below the partner's), drops it (a member that folds out of a non-power-of-two doubling hands its
 * value over), sends this rank's final value and receives an empty message (the fold-out's giver), or sends an
 * empty message and takes the partner's final value (the fold-out's taker: MPICH's fold). When the partner's message is not a uniform value of the same number, size and an
 * adjacent range, the call stops and says how far it got; the caller finishes that step and the rest in Python.
 * A call waits at most slice_ns without progress, then returns, so that its caller can look at the job's abort flag
 * and at signals, and call again: the plan holds the progress. */

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

enum { DONE = 0, SLICE = 1, OTHER = 2, CLOSED = 3, FAILED = 4, UNSUPPORTED = 5, WHOLE = 6, BOARD_WAIT = 7,
       POSTS_DIFFER = 8, RESULT_OTHER = 9 };
/* hvdrun_whole_steps' phase: the steps across hosts; the host's posts of the op's round; the leader's result */
enum { STEPS = 0, BOARD = 1, RESULT = 2 };
enum { ROUND_WORD = 0, LENGTH_WORDS = 1, SLEEPING_WORD = 3 }; /* a board slot's header (transport/posts.py) */
enum { F32 = 0, F64 = 1, I32 = 2, I64 = 3 };
enum { SUM = 0, MIN = 1, MAX = 2, PRODUCT = 3, SAME = 4 };
enum { MERGE_UPPER = 0, MERGE_LOWER = 1, DISCARD = 2, SEND_VALUE = 3, TAKE_VALUE = 4 }; /* a step's mode */

#define ABI_VERSION 7 /* compiled/__init__.py's ABI_VERSION */
#define LENGTH_BYTES 8
#define HEADER_BYTES 32

typedef struct {
    /* the layout, set once per plan */
    int32_t steps, dtype, op, tag; /* tag: the header's first byte (Uniform 0, HeldRange 2) */
    const int32_t *tx_fds, *rx_fds; /* per step */
    const uint8_t *modes;           /* per step: MERGE_UPPER, MERGE_LOWER, ... */
    int64_t nbytes;                 /* the data's size */
    int64_t spin_ns, slice_ns;      /* spin this long before sleeping in poll; return after this long without progress */
    /* the op, set per call */
    int64_t key;
    uint8_t *data;    /* this rank's value's data, merged in place */
    uint8_t *scratch; /* LENGTH_BYTES + padded(HEADER_BYTES + nbytes): the partner's frame */
    /* progress */
    int64_t step, lo, hi; /* the step under way; this rank's range so far */
    int64_t sent, got;    /* bytes of this step's frames sent and received */
    int32_t error;        /* errno of FAILED, and of CLOSED when the peer reset */
    int32_t unused2;
    /* hvdrun_whole_steps only */
    const uint8_t *source; /* copied into data as an op begins (then NULL: a call after a SLICE goes on) */
    uint8_t *target;       /* the whole job's value goes here, multiplied by factor (NULL: nowhere, a SAME value) */
    double factor;         /* 1.0, or a float type's final factor (Average's 1/ranks, a postscale) */
    int64_t ranks;         /* the job's ranks: the range 0..ranks-1 is the whole job */
    int64_t rank;          /* this rank: its range as an op begins */
    /* hvdrun_whole_steps on a host of several ranks: its post board (hvdrun/runtime/transport/posts.py) */
    int64_t members, member;     /* the host's ranks (1: no board), this rank's place among them */
    int64_t first_rank;          /* the host's first rank: member m is rank first_rank + m */
    int64_t round;               /* the board round this op posts */
    int64_t *const *words;       /* per member: its slot's header words */
    uint8_t *const *posts;       /* per member, per round parity: its post buffer (2 * members) */
    const int32_t *bells;        /* per member: the FIFO that wakes it */
    int64_t post_bytes;          /* a post's capacity */
    int32_t phase;               /* STEPS, BOARD or RESULT */
    int32_t unused3;
} Plan;

static int64_t padded(int64_t n) { return (n + 7) & ~(int64_t)7; }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

#define COMBINE(type, expression)                                                  \
    do {                                                                            \
        type *mine = (type *)plan->data;                                            \
        const type *theirs = (const type *)their_data;                              \
        if (lower)                                                                  \
            for (int64_t i = 0; i < count; i++) {                                   \
                type a = mine[i], b = theirs[i];                                    \
                mine[i] = (expression);                                             \
            }                                                                       \
        else                                                                        \
            for (int64_t i = 0; i < count; i++) {                                   \
                type a = theirs[i], b = mine[i];                                    \
                mine[i] = (expression);                                             \
            }                                                                       \
    } while (0)

/* mine = lower op upper, element-wise, bit for bit as numpy's add, multiply, minimum and maximum give it: a NaN of
 * the lower operand wins (x86 keeps the first operand's NaN, and a compiler may swap the operands of + and *, so the
 * lower NaN is taken explicitly: a + a is a, quieted); minimum and maximum give the upper operand when neither is
 * strictly less or greater, so that -0.0 and 0.0 come out as numpy's. Integers wrap (-fwrapv), as numpy's. */
#define REDUCE(type)                                                                      \
    do {                                                                                  \
        int64_t count = plan->nbytes / (int64_t)sizeof(type);                             \
        switch (plan->op) {                                                               \
        case SUM: COMBINE(type, a != a ? a + a : a + b); break;                           \
        case PRODUCT: COMBINE(type, a != a ? a * a : a * b); break;                       \
        case MIN: COMBINE(type, (a < b || a != a) ? a : b); break;                        \
        case MAX: COMBINE(type, (a > b || a != a) ? a : b); break;                        \
        default: return 0;                                                                \
        }                                                                                 \
    } while (0)

static int combine(Plan *plan, const uint8_t *their_data, int lower) {
    if (plan->op == SAME)
        return 1; /* equal, as mergeable() checked */
    switch (plan->dtype) {
    case F32: REDUCE(float); break;
    case F64: REDUCE(double); break;
    case I32: REDUCE(int32_t); break;
    case I64: REDUCE(int64_t); break;
    default: return 0;
    }
    return 1;
}

static const uint8_t zeros[8] = {0};

/* Send what is left of ``parts`` (``count`` of them) past plan->sent: 1 when some went, 0 when none could yet, -2 when
 * the peer closed, -1 on another error (plan->error). */
static int send_parts(Plan *plan, int fd, struct iovec *parts, int count) {
    int64_t skip = plan->sent;
    int first = 0;
    while (first < count && skip >= (int64_t)parts[first].iov_len) {
        skip -= (int64_t)parts[first].iov_len;
        first++;
    }
    if (first == count)
        return 0;
    parts[first].iov_base = (uint8_t *)parts[first].iov_base + skip;
    parts[first].iov_len -= (size_t)skip;
    struct msghdr msg = {0};
    msg.msg_iov = parts + first;
    msg.msg_iovlen = (size_t)(count - first);
    ssize_t sent = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (sent < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
            return 0;
        plan->error = errno;
        return errno == EPIPE || errno == ECONNRESET ? -2 : -1;
    }
    plan->sent += sent;
    return sent > 0;
}

/* Send what is left of this step's frame: length, header, data, padding (``empty``: a length of 0, nothing else). */
static int send_more(Plan *plan, int fd, int empty) {
    int64_t message = HEADER_BYTES + plan->nbytes;
    int64_t head[5] = {message, plan->tag, plan->key, plan->lo, plan->hi}; /* the tag and 7 zero bytes: a word */
    struct iovec parts[3] = {
        {head, LENGTH_BYTES + HEADER_BYTES},
        {plan->data, (size_t)plan->nbytes},
        {(void *)zeros, (size_t)(padded(message) - message)},
    };
    if (empty) {
        parts[0] = (struct iovec){(void *)zeros, LENGTH_BYTES};
        parts[1].iov_len = parts[2].iov_len = 0;
    }
    return send_parts(plan, fd, parts, 3);
}

/* Receive up to ``want`` more bytes into scratch: 1 when some came, 0 when none yet, -2 closed, -1 failed. */
static int receive_some(Plan *plan, int fd, int64_t want) {
    ssize_t count = recv(fd, plan->scratch + plan->got, (size_t)want, MSG_DONTWAIT);
    if (count == 0) {
        plan->error = 0;
        return -2;
    }
    if (count < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
            return 0;
        plan->error = errno;
        return errno == ECONNRESET ? -2 : -1;
    }
    plan->got += count;
    return 1;
}

/* Receive more of the partner's frame, never past its end: its length first, then the padded message. */
static int receive_more(Plan *plan, int fd, int64_t *need) {
    int status = receive_some(plan, fd, *need - plan->got);
    if (status <= 0)
        return status;
    if (plan->got == LENGTH_BYTES && *need == LENGTH_BYTES) {
        int64_t length;
        memcpy(&length, plan->scratch, sizeof length);
        *need = LENGTH_BYTES + padded(length);
    }
    return 1;
}

static int64_t needed(const Plan *plan) {
    if (plan->got < LENGTH_BYTES)
        return LENGTH_BYTES;
    int64_t length;
    memcpy(&length, plan->scratch, sizeof length);
    return LENGTH_BYTES + padded(length);
}

/* Whether the partner's whole message is a uniform value of this rank's tag, number and size (for SAME, also its
 * data), and (``adjacent``) its range next to this rank's, above it (``lower``: this rank's is below) or below. */
static int mergeable(const Plan *plan, int adjacent, int lower) {
    const uint8_t *message = plan->scratch + LENGTH_BYTES;
    int64_t length, words[4];
    memcpy(&length, plan->scratch, sizeof length);
    if (length != HEADER_BYTES + plan->nbytes)
        return 0;
    memcpy(words, message, sizeof words);
    if (words[0] != plan->tag || words[1] != plan->key) /* the tag and its zero padding, the number */
        return 0;
    if (plan->op == SAME && memcmp(message + HEADER_BYTES, plan->data, (size_t)plan->nbytes) != 0)
        return 0;
    if (!adjacent)
        return 1;
    return lower ? plan->hi + 1 == words[2] : words[3] + 1 == plan->lo;
}

/* The partner's whole message, by the step's mode: 0 when the caller must take over (OTHER). */
static int finish_step(Plan *plan, int mode) {
    const uint8_t *message = plan->scratch + LENGTH_BYTES;
    int64_t their_lo, their_hi;
    memcpy(&their_lo, message + 16, sizeof their_lo);
    memcpy(&their_hi, message + 24, sizeof their_hi);
    switch (mode) {
    case MERGE_UPPER:
    case MERGE_LOWER:
        if (!mergeable(plan, 1, mode == MERGE_LOWER) || !combine(plan, message + HEADER_BYTES, mode == MERGE_LOWER))
            return 0;
        if (mode == MERGE_LOWER)
            plan->hi = their_hi;
        else
            plan->lo = their_lo;
        return 1;
    case TAKE_VALUE: /* the whole job's value: this rank's own is part of it */
        if (!mergeable(plan, 0, 0))
            return 0;
        memcpy(plan->data, message + HEADER_BYTES, (size_t)plan->nbytes);
        plan->lo = their_lo;
        plan->hi = their_hi;
        return 1;
    default: /* DISCARD, SEND_VALUE: what came back is not used */
        return 1;
    }
}

/* One wait without progress: spin (yielding the core) for spin_ns after the last progress, then sleep in poll. */
static void wait_a_while(const Plan *plan, int tx, int rx, int sending, int receiving, int64_t idle_since,
                         int64_t deadline) {
    int64_t now = now_ns();
    if (now - idle_since < plan->spin_ns) {
        sched_yield();
        return;
    }
    struct pollfd fds[2];
    int count = 0;
    if (receiving)
        fds[count++] = (struct pollfd){.fd = rx, .events = POLLIN};
    if (sending)
        fds[count++] = (struct pollfd){.fd = tx, .events = POLLOUT};
    int64_t left_ms = (deadline - now) / 1000000 + 1; /* never negative: poll would wait for ever */
    poll(fds, (nfds_t)count, (int)(left_ms < 0 ? 0 : left_ms > 1000 ? 1000 : left_ms));
}

/* The interface's version: the loader rejects a library built from another one (Plan's layout, the modes, the ops). */
int hvdrun_uniform_steps_abi(void) { return ABI_VERSION; }

/* After one turn of a step's loop: after progress, the slice starts again; without, wait a while (0: the slice is
 * over, the caller returns SLICE). */
static int after_turn(const Plan *plan, int moved, int tx, int rx, int sending, int receiving, int64_t *idle_since,
                      int64_t *deadline) {
    if (moved) {
        *idle_since = now_ns();
        *deadline = *idle_since + plan->slice_ns;
        return 1;
    }
    if (now_ns() >= *deadline)
        return 0;
    wait_a_while(plan, tx, rx, sending, receiving, *idle_since, *deadline);
    return 1;
}

int hvdrun_uniform_steps(Plan *plan) {
    if (plan->op < SUM || plan->op > SAME || (plan->op != SAME && (plan->dtype < F32 || plan->dtype > I64)))
        return UNSUPPORTED;
    int64_t value_frame = LENGTH_BYTES + padded(HEADER_BYTES + plan->nbytes);
    int64_t idle_since = now_ns(), deadline = idle_since + plan->slice_ns;
    while (plan->step < plan->steps) {
        int tx = plan->tx_fds[plan->step], rx = plan->rx_fds[plan->step];
        int mode = plan->modes[plan->step];
        int64_t out_bytes = mode == TAKE_VALUE ? LENGTH_BYTES : value_frame;
        int64_t in_bytes = mode == SEND_VALUE ? LENGTH_BYTES : value_frame;
        int64_t need = needed(plan);
        if (plan->got >= LENGTH_BYTES && need != in_bytes)
            return OTHER; /* the start of the frame was received before the call (the caller's read ahead) */
        while (plan->sent < out_bytes || plan->got < need) {
            int moved = 0, status;
            if (plan->sent < out_bytes) { /* first: the partner waits for it */
                status = send_more(plan, tx, mode == TAKE_VALUE);
                if (status < 0)
                    return status == -2 ? CLOSED : FAILED;
                moved |= status;
            }
            if (plan->got < need) {
                status = receive_more(plan, rx, &need);
                if (status < 0)
                    return status == -2 ? CLOSED : FAILED;
                moved |= status;
                if (plan->got == LENGTH_BYTES && need != in_bytes)
                    return OTHER; /* not what this step takes from a uniform partner: the caller reads the rest */
            }
            if (!after_turn(plan, moved, tx, rx, plan->sent < out_bytes, plan->got < need, &idle_since, &deadline))
                return SLICE;
        }
        if (!finish_step(plan, mode))
            return OTHER;
        plan->step++;
        plan->sent = plan->got = 0;
    }
    return DONE;
}

/* Send what is left of this step's raw frame: the data, then zeros up to 8 bytes. */
static int send_raw(Plan *plan, int fd) {
    struct iovec parts[2] = {
        {plan->data, (size_t)plan->nbytes},
        {(void *)zeros, (size_t)(padded(plan->nbytes) - plan->nbytes)},
    };
    return send_parts(plan, fd, parts, 2);
}

/* The core steps of a plain recursive doubling of a buffer (hvdrun/runtime/collectives/pairwise.py,
 * Pairwise.allreduce_doubling): each step swaps the whole buffer, padded to 8 bytes, with no length or header, and
 * reduces the partner's copy into this rank's, this rank's operand first (as Python's reduce(flat, incoming)). Every
 * step's mode is ignored; the data is the caller's buffer, reduced in place. */
int hvdrun_raw_steps(Plan *plan) {
    if (plan->op < SUM || plan->op > PRODUCT || plan->dtype < F32 || plan->dtype > I64)
        return UNSUPPORTED;
    int64_t frame = padded(plan->nbytes);
    int64_t idle_since = now_ns(), deadline = idle_since + plan->slice_ns;
    while (plan->step < plan->steps) {
        int tx = plan->tx_fds[plan->step], rx = plan->rx_fds[plan->step];
        while (plan->sent < frame || plan->got < frame) {
            int moved = 0, status;
            if (plan->sent < frame) {
                status = send_raw(plan, tx);
                if (status < 0)
                    return status == -2 ? CLOSED : FAILED;
                moved |= status;
            }
            if (plan->got < frame) {
                status = receive_some(plan, rx, frame - plan->got);
                if (status < 0)
                    return status == -2 ? CLOSED : FAILED;
                moved |= status;
            }
            if (!after_turn(plan, moved, tx, rx, plan->sent < frame, plan->got < frame, &idle_since, &deadline))
                return SLICE;
        }
        combine(plan, plan->scratch, 1);
        plan->step++;
        plan->sent = plan->got = 0;
    }
    return DONE;
}

/* The whole job's value, scaled, into plan->target: mine * factor as numpy's multiply gives it (a float32 array times
 * a Python float multiplies in float32); integer types are only copied (the caller scales them). */
static void write_whole(const Plan *plan) {
    int64_t i, count;
    if (plan->factor == 1.0 || (plan->dtype != F32 && plan->dtype != F64)) {
        memmove(plan->target, plan->data, (size_t)plan->nbytes);
    } else if (plan->dtype == F32) {
        const float *mine = (const float *)plan->data;
        float *out = (float *)plan->target, factor = (float)plan->factor;
        for (i = 0, count = plan->nbytes / 4; i < count; i++)
            out[i] = mine[i] * factor;
    } else {
        const double *mine = (const double *)plan->data;
        double *out = (double *)plan->target, factor = plan->factor;
        for (i = 0, count = plan->nbytes / 8; i < count; i++)
            out[i] = mine[i] * factor;
    }
}

/* Post on the host's board in plan->round: this rank's uniform value (the message Python's codec writes: the 32-byte
 * header and the data, no length word), or (``empty``) an empty message; publish the round, ring the members that
 * sleep. */
static void post_on_board(Plan *plan, int empty) {
    int64_t parity = plan->round & 1, *me = plan->words[plan->member];
    uint8_t *post = plan->posts[plan->member * 2 + parity];
    if (!empty) {
        int64_t head[4] = {plan->tag, plan->key, plan->lo, plan->hi};
        memcpy(post, head, HEADER_BYTES);
        memcpy(post + HEADER_BYTES, plan->data, (size_t)plan->nbytes);
    }
    me[LENGTH_WORDS + parity] = empty ? 0 : HEADER_BYTES + plan->nbytes;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(&me[ROUND_WORD], plan->round, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the round before the sleeping words: a sleeper sees one or the other */
    for (int64_t m = 0; m < plan->members; m++) {
        if (m != plan->member && __atomic_load_n(&plan->words[m][SLEEPING_WORD], __ATOMIC_ACQUIRE)) {
            ssize_t ignored = write(plan->bells[m], zeros, 1); /* a full FIFO wakes it as well */
            (void)ignored;
        }
    }
}

static int all_posted(const Plan *plan) {
    for (int64_t m = 0; m < plan->members; m++)
        if (__atomic_load_n(&plan->words[m][ROUND_WORD], __ATOMIC_ACQUIRE) < plan->round)
            return 0;
    return 1;
}

/* Whether member m's post of plan->round is this op's uniform value of the ranks lo..hi: its length, its header
 * (the tag, the number, the range) and, for op SAME, the same data as this rank's. */
static int post_holds(const Plan *plan, int64_t m, int64_t lo, int64_t hi) {
    int64_t parity = plan->round & 1, head[4];
    const uint8_t *post = plan->posts[m * 2 + parity];
    if (plan->words[m][LENGTH_WORDS + parity] != HEADER_BYTES + plan->nbytes)
        return 0;
    memcpy(head, post, sizeof head);
    if (head[0] != plan->tag || head[1] != plan->key || head[2] != lo || head[3] != hi)
        return 0;
    return plan->op != SAME || memcmp(post + HEADER_BYTES, plan->data, (size_t)plan->nbytes) == 0;
}

/* Every member's post as one uniform value of the host's ranks, reduced in member order into plan->data by the
 * leader (member 0; as Python's merge of the posts, lower ranks first): 0 when a post is anything else (the caller
 * merges them in Python; every member sees the same posts, so all of them do). */
static int merge_posts(Plan *plan) {
    int64_t parity = plan->round & 1;
    for (int64_t m = 0; m < plan->members; m++)
        if (!post_holds(plan, m, plan->first_rank + m, plan->first_rank + m))
            return 0;
    if (plan->member != 0 && plan->steps > 0)
        return 1; /* the leader merges and crosses; this rank reads its result (one host: every member merges) */
    memcpy(plan->data, plan->posts[parity] + HEADER_BYTES, (size_t)plan->nbytes);
    for (int64_t m = 1; m < plan->members; m++)
        combine(plan, plan->posts[m * 2 + parity] + HEADER_BYTES, 1);
    plan->lo = plan->first_rank;
    plan->hi = plan->first_rank + plan->members - 1;
    return 1;
}

/* Every member's post of plan->round, spinning (yielding the core) at most spin_ns: 0 when they are there, else
 * BOARD_WAIT (the caller sleeps until they are and calls again). */
static int await_posts(const Plan *plan) {
    int64_t began = now_ns();
    while (!all_posted(plan)) {
        if (now_ns() - began >= plan->spin_ns)
            return BOARD_WAIT;
        sched_yield();
    }
    return 0;
}

/* The leader's post of the result round as the whole job's value of this op, into plan->data: 0 when it is another
 * value (Python reads it). */
static int take_result(Plan *plan) {
    if (!post_holds(plan, 0, 0, plan->ranks - 1))
        return 0;
    memcpy(plan->data, plan->posts[plan->round & 1] + HEADER_BYTES, (size_t)plan->nbytes);
    plan->lo = 0;
    plan->hi = plan->ranks - 1;
    return 1;
}

/* A lone allreduce of the steady state in one call (or a held range's cycle, op SAME). An op begins when
 * plan->source is set: this rank's data is copied into plan->data, its range is this rank, no step is begun. On a
 * host of several ranks it is posted on the board; once the host's posts are all there, the leader (member 0)
 * reduces them into the host's value, and the others post an empty message in the next round (a job of one host:
 * every member reduces them, and that is the job's value). The leader's value
 * (every rank's, on a host of one rank) goes through hvdrun_uniform_steps across hosts; on a host of several ranks
 * the leader posts the job's value in that next round, which every member reads once all of it is posted. When the
 * value is the whole job's, it is written to plan->target, scaled (WHOLE; a held range's numbers, which every rank
 * must share, are checked equal at every merge and written nowhere: plan->target is NULL). Else: BOARD_WAIT (call
 * again once every member posted plan->round), POSTS_DIFFER (Python merges the posts of this round), RESULT_OTHER
 * (the leader posted another value: Python reads it), or hvdrun_uniform_steps' status, plan->data merged as far as
 * the steps went. */
int hvdrun_whole_steps(Plan *plan) {
    if (plan->members > 1 && HEADER_BYTES + plan->nbytes > plan->post_bytes)
        return UNSUPPORTED;
    if (plan->source != NULL) {
        memcpy(plan->data, plan->source, (size_t)plan->nbytes);
        plan->source = NULL;
        plan->lo = plan->hi = plan->rank;
        plan->step = plan->sent = plan->got = 0;
        plan->phase = STEPS;
        if (plan->members > 1) {
            post_on_board(plan, 0);
            plan->phase = BOARD;
        }
    }
    if (plan->phase == BOARD) {
        if (await_posts(plan))
            return BOARD_WAIT;
        if (!merge_posts(plan))
            return POSTS_DIFFER;
        plan->phase = STEPS;
        if (plan->member != 0 && plan->steps > 0) {
            plan->round++;
            post_on_board(plan, 1);
            plan->phase = RESULT;
        }
    }
    if (plan->phase == STEPS) {
        int status = hvdrun_uniform_steps(plan);
        if (status != DONE || plan->lo != 0 || plan->hi != plan->ranks - 1)
            return status;
        if (plan->members > 1 && plan->steps > 0) {
            plan->round++;
            post_on_board(plan, 0);
            plan->phase = RESULT;
        }
    }
    if (plan->phase == RESULT) {
        if (await_posts(plan))
            return BOARD_WAIT;
        if (plan->member != 0 && !take_result(plan))
            return RESULT_OTHER;
    }
    if (plan->target != NULL)
        write_whole(plan);
    return WHOLE;
}
