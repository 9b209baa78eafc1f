/* commviz's NCCL profiler plugin: the GPU start and end of every NCCL collective and p2p op.
 *
 * NCCL loads it through NCCL_PROFILER_PLUGIN (commviz.start sets it, commviz/record/
 * nccl_plugin.py builds it). Its kernels stamp each channel's start and end with the GPU's
 * %globaltimer into host memory; NCCL's proxy thread hands those stamps to this plugin as
 * kernel-channel events. Per op the calling thread does only this: NCCL's task event (Coll or
 * P2p, on the thread that enqueues the op, inside the c10d call) fills a slot of a ring with the
 * op's description, the thread and the wall time. The proxy thread collects the channels' stamps
 * and, when the last channel has ended, appends one fixed entry to the rank's file
 * (COMMVIZ_GPUTIME_FILE), a shared mapping of it: stores go to the page cache, which outlives
 * a SIGKILL, and no entry costs a syscall. commviz/live/gputime.py reads the file and matches
 * its ops to commviz's records (thread and time: each op is enqueued inside its c10d call).
 *
 * File: a 4096-byte header (MAGIC, entry size, pid, sampling), then ENTRY_SIZE-byte entries
 * whose first 4 bytes (their kind) are stored last, so a slot not fully written reads as empty.
 * The file grows a chunk at a time (posix_fallocate: a full disk drops entries, no SIGBUS).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "nccl_profiler.h"

#define MAGIC "commviz.gputime.1\n"
#define HEADER_SIZE 4096
#define ENTRY_SIZE 80
#define CHUNK_ENTRIES 16384                        /* 1.25 MiB: a whole number of pages */
#define CHUNK_BYTES ((size_t)CHUNK_ENTRIES * ENTRY_SIZE)
#define MAX_CHUNKS 8192                            /* 134M entries, 10 GiB */
#define RING 4096                                  /* ops in flight per communicator */
#define NAMES 64                                   /* distinct func names */
#define MASK (ncclProfileColl | ncclProfileP2p | ncclProfileKernelCh)
/* sampling (COMMVIZ_GPUTIME_EVERY=k > 1): NCCL copies its activation mask into each call's tasks
   when the call starts, so the plugin, told of each call by its group API event, sets the mask
   for the next call: the full one for every k-th, the group event alone for the others (no
   stamps, no proxy work) */
#define SAMPLED ncclProfileGroupApi

enum { KIND_OP = 1, KIND_COMM = 2, KIND_NAME = 3 };
enum { FLAG_P2P = 1, FLAG_PARTIAL = 2, FLAG_REPLAY = 4 };

typedef struct {                  /* KIND_OP: one op's GPU time */
  uint32_t kind;
  uint8_t func;                   /* a KIND_NAME entry's code */
  uint8_t flags;
  uint8_t channels;               /* channels that reported an end */
  uint8_t expected;               /* channels NCCL gave the op */
  uint64_t comm;                  /* NCCL's commHash */
  uint64_t seq;                   /* NCCL's seqNumber (per comm and func); p2p: the comm's count */
  uint64_t bytes;                 /* count x datatype size (0: size unknown) */
  int32_t peer;                   /* p2p peer / collective root, ranks of the communicator */
  int32_t tid;                    /* the thread NCCL enqueued it on */
  int64_t t_enqueue;              /* CLOCK_REALTIME ns then */
  uint64_t gpu_start;             /* %globaltimer ns: the first channel's start */
  uint64_t gpu_end;               /* %globaltimer ns: the last channel's end */
  int64_t t_seen_start;           /* CLOCK_REALTIME ns when the proxy saw the first start */
  int64_t t_seen_end;             /* CLOCK_REALTIME ns when the proxy saw the last end */
} Entry;

typedef struct {                  /* KIND_COMM: a communicator NCCL made */
  uint32_t kind;
  int32_t rank;
  uint64_t comm;
  int32_t nranks;
  int32_t nnodes;
  char name[56];
} CommEntry;

typedef struct {                  /* KIND_NAME: a func name's code */
  uint32_t kind;
  uint32_t code;
  char name[72];
} NameEntry;

_Static_assert(sizeof(Entry) == ENTRY_SIZE, "entry layout");
_Static_assert(sizeof(CommEntry) == ENTRY_SIZE, "comm entry layout");
_Static_assert(sizeof(NameEntry) == ENTRY_SIZE, "name entry layout");
_Static_assert(CHUNK_BYTES % 4096 == 0, "chunks start on pages");

typedef struct Comm Comm;

typedef struct {                  /* an op in flight: NCCL's handle for its task event */
  uint64_t type;                  /* ncclProfileColl / ncclProfileP2p */
  Comm* comm;
  Entry e;                        /* filled as it goes, copied out when the last channel ends */
  uint32_t started, ended;        /* channels */
} __attribute__((aligned(128))) Op; /* low 7 bits free: a channel's handle is op | (channel+1) */

struct Comm {
  uint64_t hash;
  uint64_t next;                  /* ops begun on this communicator */
  uint64_t p2p;                   /* p2p ops begun */
  uint64_t api, api_used;         /* eager API calls (ncclAllReduce, ncclSend, ...), and those
                                     whose op has begun: an op begun with none left is a CUDA
                                     graph replay's (NCCL makes no API event for those) */
  Op ops[RING];
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int fd = -1;
static int users;                                   /* communicators initialised, not finalised */
static int* mask_cell;                              /* NCCL's activation mask (one per process) */
static int enabled = 1;
static int every = 1;                               /* time one call in ``every`` */
static uint64_t calls;                              /* calls seen (sampling) */
static uint64_t next_entry;
static uint64_t dropped;
static char* chunks[MAX_CHUNKS];
static const char* name_ptr[NAMES];
static int name_code[NAMES];
static int n_names;
static __thread int32_t my_tid;

static int64_t now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int32_t thread_id(void) {
  if (my_tid == 0) my_tid = (int32_t)syscall(SYS_gettid);
  return my_tid;
}

/* The slot of entry ``i``, mapping its chunk first if needed; NULL: dropped. */
static char* slot(uint64_t i) {
  uint64_t c = i / CHUNK_ENTRIES;
  if (c >= MAX_CHUNKS || fd < 0) return NULL;
  char* base = __atomic_load_n(&chunks[c], __ATOMIC_ACQUIRE);
  if (base == NULL) {
    pthread_mutex_lock(&lock);
    base = chunks[c];
    if (base == NULL && fd >= 0) {
      off_t at = HEADER_SIZE + (off_t)(c * CHUNK_BYTES);
      if (posix_fallocate(fd, at, (off_t)CHUNK_BYTES) == 0) {
        void* m = mmap(NULL, CHUNK_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, at);
        if (m != MAP_FAILED) {
          base = (char*)m;
          __atomic_store_n(&chunks[c], base, __ATOMIC_RELEASE);
        }
      }
    }
    pthread_mutex_unlock(&lock);
    if (base == NULL) return NULL;
  }
  return base + (i % CHUNK_ENTRIES) * ENTRY_SIZE;
}

/* Append ``size`` bytes of an entry; its kind (first 4 bytes) is stored last. */
static void append(const void* entry) {
  char* p = slot(__atomic_fetch_add(&next_entry, 1, __ATOMIC_RELAXED));
  if (p == NULL) {
    __atomic_fetch_add(&dropped, 1, __ATOMIC_RELAXED);
    return;
  }
  memcpy(p + 4, (const char*)entry + 4, ENTRY_SIZE - 4);
  __atomic_store_n((uint32_t*)p, *(const uint32_t*)entry, __ATOMIC_RELEASE);
}

static void copy_name(char* out, size_t size, const char* name) {
  memset(out, 0, size);
  if (name) strncpy(out, name, size - 1);
}

/* A func name's code (its pointer is NCCL's static string: compared by address, then text). */
static uint8_t func_code(const char* name) {
  int n = __atomic_load_n(&n_names, __ATOMIC_ACQUIRE);
  for (int i = 0; i < n; i++)
    if (name_ptr[i] == name) return (uint8_t)name_code[i];
  pthread_mutex_lock(&lock);
  int code = 0;
  for (int i = 0; i < n_names; i++)
    if (name_ptr[i] == name || (name && name_ptr[i] && strcmp(name_ptr[i], name) == 0))
      code = name_code[i];
  if (code == 0 && n_names < NAMES) {
    code = n_names + 1;
    NameEntry e = {KIND_NAME, (uint32_t)code, {0}};
    copy_name(e.name, sizeof e.name, name ? name : "?");
    append(&e);
  }
  if (n_names < NAMES) {
    name_ptr[n_names] = name;
    name_code[n_names] = code;
    __atomic_store_n(&n_names, n_names + 1, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&lock);
  return (uint8_t)code;
}

/* Bytes per element of an NCCL datatype name ("ncclFloat32", "ncclBfloat16", ...). */
static uint64_t type_size(const char* t) {
  if (t == NULL) return 0;
  size_t n = strlen(t);
  if (n >= 2 && strcmp(t + n - 2, "64") == 0) return 8;
  if (n >= 2 && strcmp(t + n - 2, "32") == 0) return 4;
  if (n >= 2 && strcmp(t + n - 2, "16") == 0) return 2;
  if (strstr(t, "8")) return 1;
  return 0;
}

static int open_file(void) {
  const char* path = getenv("COMMVIZ_GPUTIME_FILE");
  if (path == NULL || *path == 0) return -1;
  /* the same process reopening its file (NCCL unloads the plugin when its last communicator
     goes, and loads it again for the next): go on after the entries there */
  int f = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (f < 0) return -1;
  char head[HEADER_SIZE] = {0};
  struct stat st;
  int64_t pid = getpid();
  if (fstat(f, &st) == 0 && st.st_size >= HEADER_SIZE
      && pread(f, head, HEADER_SIZE, 0) == HEADER_SIZE
      && memcmp(head, MAGIC, sizeof MAGIC - 1) == 0 && *(int64_t*)(head + 32) == pid) {
    uint64_t chunks_there = (uint64_t)(st.st_size - HEADER_SIZE + CHUNK_BYTES - 1) / CHUNK_BYTES;
    next_entry = chunks_there * CHUNK_ENTRIES;
    return f;
  }
  if (ftruncate(f, 0) != 0 || posix_fallocate(f, 0, HEADER_SIZE) != 0) {
    close(f);
    return -1;
  }
  memset(head, 0, sizeof head);
  memcpy(head, MAGIC, sizeof MAGIC - 1);
  *(uint32_t*)(head + 24) = ENTRY_SIZE;
  *(uint32_t*)(head + 28) = HEADER_SIZE;
  *(int64_t*)(head + 32) = pid;
  *(int64_t*)(head + 40) = now();
  *(int32_t*)(head + 48) = every;
  if (pwrite(f, head, HEADER_SIZE, 0) != HEADER_SIZE) {
    close(f);
    return -1;
  }
  next_entry = 0;
  return f;
}

static int full_mask(void) { return every > 1 ? MASK | SAMPLED : MASK; }

static ncclResult_t init(void** context, uint64_t commId, int* eActivationMask,
                         const char* commName, int nNodes, int nranks, int rank,
                         ncclDebugLogger_t logfn) {
  (void)logfn;
  *context = NULL;
  pthread_mutex_lock(&lock);
  if (fd < 0) {
    const char* k = getenv("COMMVIZ_GPUTIME_EVERY");
    every = k && atoi(k) > 1 ? atoi(k) : 1;
    fd = open_file();
  }
  int ok = fd >= 0;
  if (ok) {
    users++;
    mask_cell = eActivationMask;
  }
  pthread_mutex_unlock(&lock);
  if (!ok) {                       /* no file to write: NCCL profiles nothing for us */
    *eActivationMask = 0;
    return ncclSuccess;
  }
  Comm* c = (Comm*)aligned_alloc(128, sizeof(Comm));
  if (c == NULL) return ncclSuccess;
  memset(c, 0, sizeof *c);
  c->hash = commId;
  *context = c;
  *eActivationMask = __atomic_load_n(&enabled, __ATOMIC_RELAXED) ? full_mask() : 0;
  CommEntry e = {KIND_COMM, rank, commId, nranks, nNodes, {0}};
  copy_name(e.name, sizeof e.name, commName);
  append(&e);
  return ncclSuccess;
}

/* The op's entry goes to the file (its last channel ended, or its slot is needed again). */
static void finish(Op* op, int partial) {
  op->e.kind = KIND_OP;
  op->e.channels = (uint8_t)op->ended;
  if (partial) op->e.flags |= FLAG_PARTIAL;
  op->e.t_seen_end = now();
  append(&op->e);
  op->type = 0;
}

static ncclResult_t start_event(void* context, void** eHandle, ncclProfilerEventDescr_v5_t* d) {
  *eHandle = NULL;
  Comm* c = (Comm*)context;
  if (c == NULL) return ncclSuccess;
  if (d->type == SAMPLED) {                                        /* a call starts */
    if (every > 1 && mask_cell && __atomic_load_n(&enabled, __ATOMIC_RELAXED)) {
      uint64_t n = __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
      __atomic_store_n(mask_cell, (n + 1) % (uint64_t)every == 0 ? MASK | SAMPLED : SAMPLED,
                       __ATOMIC_RELAXED);
    }
  } else if (d->type == ncclProfileCollApi || d->type == ncclProfileP2pApi) {
    int captured = d->type == ncclProfileCollApi ? d->collApi.graphCaptured
                                                 : d->p2pApi.graphCaptured;
    if (!captured) __atomic_add_fetch(&c->api, 1, __ATOMIC_RELAXED);
  } else if (d->type == ncclProfileColl || d->type == ncclProfileP2p) {   /* the calling thread */
    int p2p = d->type == ncclProfileP2p;
    uint64_t used = __atomic_load_n(&c->api_used, __ATOMIC_RELAXED);
    int replay = 1;
    while (used < __atomic_load_n(&c->api, __ATOMIC_RELAXED))
      if (__atomic_compare_exchange_n(&c->api_used, &used, used + 1, 0, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
        replay = 0;
        break;
      }
    uint64_t n = __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED);
    Op* op = &c->ops[n % RING];
    if (op->type != 0 && op->ended > 0) finish(op, 1);   /* RING ops later, still not ended */
    Entry* e = &op->e;
    memset(e, 0, sizeof *e);
    e->comm = c->hash;
    e->tid = thread_id();
    e->t_enqueue = now();
    e->gpu_start = UINT64_MAX;
    e->flags = replay ? FLAG_REPLAY : 0;
    if (p2p) {
      e->flags |= FLAG_P2P;
      e->func = func_code(d->p2p.func);
      e->seq = __atomic_fetch_add(&c->p2p, 1, __ATOMIC_RELAXED);
      e->bytes = d->p2p.count * type_size(d->p2p.datatype);
      e->peer = d->p2p.peer;
      e->expected = d->p2p.nChannels;
    } else {
      e->func = func_code(d->coll.func);
      e->seq = d->coll.seqNumber;
      e->bytes = d->coll.count * type_size(d->coll.datatype);
      e->peer = d->coll.root;
      e->expected = d->coll.nChannels;
    }
    op->comm = c;
    op->started = op->ended = 0;
    op->type = d->type;
    *eHandle = op;
  } else if (d->type == ncclProfileKernelCh) {                     /* the proxy thread */
    Op* op = (Op*)d->parentObj;
    if (op == NULL || (op->type != ncclProfileColl && op->type != ncclProfileP2p))
      return ncclSuccess;
    uint64_t t = d->kernelCh.pTimer;
    if (t < op->e.gpu_start) op->e.gpu_start = t;
    if (op->started++ == 0) op->e.t_seen_start = now();
    *eHandle = (void*)((uintptr_t)op | (uintptr_t)(d->kernelCh.channelId % 127 + 1));
  }
  return ncclSuccess;
}

static ncclResult_t record_state(void* eHandle, ncclProfilerEventState_v5_t state,
                                 ncclProfilerEventStateArgs_v5_t* args) {
  uintptr_t h = (uintptr_t)eHandle;
  if (state != ncclProfilerKernelChStop || (h & 127) == 0 || args == NULL)
    return ncclSuccess;
  Op* op = (Op*)(h & ~(uintptr_t)127);
  if (args->kernelCh.pTimer > op->e.gpu_end) op->e.gpu_end = args->kernelCh.pTimer;
  return ncclSuccess;
}

static ncclResult_t stop_event(void* eHandle) {
  uintptr_t h = (uintptr_t)eHandle;
  if ((h & 127) == 0) return ncclSuccess;   /* a task event stops when enqueued: keep it open */
  Op* op = (Op*)(h & ~(uintptr_t)127);
  if (op->type == 0) return ncclSuccess;
  op->ended++;
  if (op->ended >= op->e.expected && op->ended >= op->started) finish(op, 0);
  return ncclSuccess;
}

static ncclResult_t finalize(void* context) {
  Comm* c = (Comm*)context;
  if (c == NULL) return ncclSuccess;
  for (int i = 0; i < RING; i++)            /* ops whose last channel never reported */
    if (c->ops[i].type != 0 && c->ops[i].ended > 0) finish(&c->ops[i], 1);
  free(c);
  pthread_mutex_lock(&lock);
  if (--users == 0) {
    /* the mappings stay: NCCL may load this again for a later communicator, and a reopened
       file goes on after them (open_file) */
    mask_cell = NULL;
  }
  pthread_mutex_unlock(&lock);
  return ncclSuccess;
}

/* Turn GPU timing on or off for ops enqueued from now on (NCCL's mask is read per call); returns
   whether it was on. commviz calls it through ctypes. */
__attribute__((visibility("default"))) int commviz_gputime_enable(int on) {
  int was = __atomic_exchange_n(&enabled, on ? 1 : 0, __ATOMIC_RELAXED);
  pthread_mutex_lock(&lock);
  if (mask_cell) __atomic_store_n(mask_cell, on ? full_mask() : 0, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&lock);
  return was;
}

/* Entries this process could not write (a full disk, MAX_CHUNKS reached). */
__attribute__((visibility("default"))) uint64_t commviz_gputime_dropped(void) {
  return __atomic_load_n(&dropped, __ATOMIC_RELAXED);
}

__attribute__((visibility("default"))) ncclProfiler_v5_t ncclProfiler_v5 = {
    "commviz", init, start_event, stop_event, record_state, finalize};
