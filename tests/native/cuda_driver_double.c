/* A test double of the CUDA driver API over host memory: built by the tests, never shipped.
 *
 * It exports the few driver functions pyshmckpt loads at run time, with the real driver's ABI, so
 * that the control flow around them (registration in chunks, async copies, event polling, timeouts,
 * sticky errors) runs in CI on machines without a GPU. Tests load it through the same path as the
 * real driver (PYSHMCKPT_CUDA_DRIVER=<this library>) and inspect it through the double_* functions.
 *
 * Model: a CUdeviceptr is a host address and a copy is a memcpy. Copies go into one FIFO queue,
 * whatever the stream, run by one worker thread, each after an optional delay; an event recorded on
 * a stream completes once every copy queued before it has run (an event never recorded is
 * complete). A copy's destination need not be registered (pageable copies are not made
 * synchronous as with the real driver: use double_copy_log to check where copies went).
 *
 * As with the real driver, every function but cuInit, cuDriverGetVersion and cuGetError* returns
 * CUDA_ERROR_NOT_INITIALIZED before a successful cuInit, and cuMemHostRegister_v2,
 * cuMemHostUnregister, cuMemcpyDtoHAsync_v2, cuEventCreate and cuEventRecord return
 * CUDA_ERROR_INVALID_CONTEXT on a thread with no current context (cuCtxSetCurrent of the context
 * cuDevicePrimaryCtxRetain gives): a real driver fails such calls from a thread torch never used.
 *
 * Configured by the first cuInit (and by double_reconfigure) from the environment; a value that is
 * not a decimal integer >= 0 makes cuInit return CUDA_ERROR_INVALID_VALUE:
 *   PYSHMCKPT_DOUBLE_DEVICES         device count (default 1); 0: cuInit returns
 *                                    CUDA_ERROR_NO_DEVICE, as on a machine without a GPU.
 *   PYSHMCKPT_DOUBLE_DRIVER_VERSION  what cuDriverGetVersion reports (default 12080, i.e. 12.8).
 *   PYSHMCKPT_DOUBLE_COPY_DELAY_MS   the worker waits this long before each copy (default 0).
 *   PYSHMCKPT_DOUBLE_FAIL_REGISTER_AT=N  the Nth cuMemHostRegister_v2 call (1-based, counted since
 *                                    cuInit, double_reset_counters or double_reconfigure; a call
 *                                    that fails for another reason counts too) returns
 *                                    CUDA_ERROR_OUT_OF_MEMORY and registers nothing (default 0: none).
 *   PYSHMCKPT_DOUBLE_FAIL_COPY_AT=N  the Nth cuMemcpyDtoHAsync_v2 call returns FAIL_CODE at once and
 *                                    queues nothing (default 0: none).
 *   PYSHMCKPT_DOUBLE_FAIL_CODE=C     that failure's code (default 1). A sticky code (the driver's:
 *                                    CUDA_ERROR_ILLEGAL_ADDRESS 700, CUDA_ERROR_LAUNCH_FAILED 719,
 *                                    702, 714-718) poisons the device: every later call to register,
 *                                    unregister, copy, events and pointer attributes returns C,
 *                                    pending events included (device and context calls still work).
 *                                    Copies queued before still run: a driver gives no promise
 *                                    that they stopped, so their memory must stay mapped.
 *
 *   PYSHMCKPT_DOUBLE_FAIL_BATCH_CODE=C  every cuMemcpyBatchAsync_v2 call returns C and queues
 *                                    nothing (default 0: none); a sticky C poisons as above.
 *
 * Compiled with -DDOUBLE_OLD_DRIVER it does not export cuMemcpyDtoHAsync_v2: a driver too old for it.
 * Compiled with -DDOUBLE_BATCH it also exports cuMemcpyBatchAsync_v2 (CUDA 13's ABI): a batch's
 * copies are queued in order, each logged as a copy call would be, after the driver's checks of
 * its arguments (a null stream, a missing or malformed attribute list: CUDA_ERROR_INVALID_VALUE,
 * nothing queued).
 */
#define _DEFAULT_SOURCE /* usleep */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#ifdef DOUBLE_OLD_DRIVER /* the same code, not exported */
#define EXPORT_COPY static __attribute__((unused))
#else
#define EXPORT_COPY EXPORT
#endif
#ifdef DOUBLE_BATCH
#define EXPORT_BATCH EXPORT
#else
#define EXPORT_BATCH static __attribute__((unused))
#endif

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;
typedef unsigned long long CUdeviceptr;

enum {
  SUCCESS = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, NO_DEVICE = 100,
  INVALID_DEVICE = 101, INVALID_CONTEXT = 201, INVALID_HANDLE = 400, NOT_READY = 600,
  ILLEGAL_ADDRESS = 700, ALREADY_REGISTERED = 712, NOT_REGISTERED = 713, LAUNCH_FAILED = 719,
};
enum { MAX_DEVICES = 64, MEMORYTYPE_ATTRIBUTE = 2, MEMORYTYPE_HOST = 1 };

static const struct { CUresult code; const char* name; const char* text; } ERRORS[] = {
  {SUCCESS, "CUDA_SUCCESS", "no error"},
  {INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
  {OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
  {NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
  {NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
  {INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
  {INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
  {INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
  {NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
  {ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
  {ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
   "part or all of the requested memory range is already mapped"},
  {NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
   "pointer does not correspond to a registered memory region"},
  {LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
};

struct CUevent_st { uint64_t ticket; }; /* complete once `done` reaches `ticket` */
struct range { uintptr_t base; size_t bytes; };
struct copy { void* dst; const void* src; size_t bytes; struct copy* next; };
/* CUmemcpyAttributes as the driver's ABI has it (CUDA 12.8). */
struct memcpy_attributes {
  int src_access_order;
  int src_location_type, src_location_id, dst_location_type, dst_location_id;
  unsigned flags;
};

/* All state is guarded by `lock`; `changed` wakes the worker (new copy, hold released). */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static int initialized, devices, driver_version = 12080, copy_delay_ms, held;
static long long fail_register_at, fail_copy_at;
static CUresult fail_code = INVALID_VALUE, fail_batch_code, poison;
static long long register_calls, unregister_calls, copy_calls, batch_calls;
static struct range* ranges;
static size_t n_ranges, cap_ranges, registered_bytes;
static struct copy *head, *tail; /* the FIFO of queued copies */
static uint64_t queued, done;    /* copies queued and run since cuInit */
static uint64_t* copy_log;       /* (dst, src, bytes) of every copy call */
static size_t n_log, cap_log;
static char contexts[MAX_DEVICES]; /* primary contexts: distinct addresses, never dereferenced */
static _Thread_local CUcontext current;

static int grow(void** array, size_t* cap, size_t need, size_t size) {
  if (need <= *cap) return 1;
  size_t cap2 = *cap ? 2 * *cap : 64;
  while (cap2 < need) cap2 *= 2;
  void* p = realloc(*array, cap2 * size);
  if (!p) return 0;
  *array = p;
  *cap = cap2;
  return 1;
}

static int env_int(const char* name, long long fallback, long long* out) {
  const char* s = getenv(name);
  *out = fallback;
  if (!s || !*s) return 1;
  char* end;
  *out = strtoll(s, &end, 10);
  return *end == '\0' && *out >= 0 && *out <= INT32_MAX;
}

/* Reads the environment and clears poison and counters; `lock` held. */
static CUresult configure(void) {
  long long d, v, delay, reg_at, copy_at, code, batch_code;
  if (!env_int("PYSHMCKPT_DOUBLE_DEVICES", 1, &d) || d > MAX_DEVICES ||
      !env_int("PYSHMCKPT_DOUBLE_DRIVER_VERSION", 12080, &v) ||
      !env_int("PYSHMCKPT_DOUBLE_COPY_DELAY_MS", 0, &delay) ||
      !env_int("PYSHMCKPT_DOUBLE_FAIL_REGISTER_AT", 0, &reg_at) ||
      !env_int("PYSHMCKPT_DOUBLE_FAIL_COPY_AT", 0, &copy_at) ||
      !env_int("PYSHMCKPT_DOUBLE_FAIL_CODE", INVALID_VALUE, &code) ||
      !env_int("PYSHMCKPT_DOUBLE_FAIL_BATCH_CODE", 0, &batch_code))
    return INVALID_VALUE;
  devices = (int)d;
  driver_version = (int)v;
  copy_delay_ms = (int)delay;
  fail_register_at = reg_at;
  fail_copy_at = copy_at;
  fail_code = (CUresult)code;
  fail_batch_code = (CUresult)batch_code;
  poison = SUCCESS;
  register_calls = unregister_calls = copy_calls = batch_calls = 0;
  n_log = 0;
  return devices == 0 ? NO_DEVICE : SUCCESS;
}

static void* worker(void* unused) {
  (void)unused;
  pthread_mutex_lock(&lock);
  for (;;) {
    while (!head) pthread_cond_wait(&changed, &lock);
    if (copy_delay_ms > 0) {
      pthread_mutex_unlock(&lock);
      usleep((useconds_t)copy_delay_ms * 1000);
      pthread_mutex_lock(&lock);
    }
    while (held) pthread_cond_wait(&changed, &lock);
    /* The copy runs under the lock, so that no copy runs once double_hold_copies(1) returns. */
    struct copy* c = head;
    memcpy(c->dst, c->src, c->bytes);
    head = c->next;
    if (!head) tail = NULL;
    free(c);
    done++;
  }
  return NULL;
}

/* Locks, counts the call in `calls` (when given) once initialized, and makes the driver's checks
   in order, up to `check`: initialized, then not poisoned, then a current context. */
enum check { CHECK_INIT, CHECK_POISON, CHECK_CONTEXT };
static CUresult enter(enum check check, long long* calls) {
  pthread_mutex_lock(&lock);
  if (!initialized) return NOT_INITIALIZED;
  if (calls) ++*calls;
  if (check >= CHECK_POISON && poison) return poison;
  if (check >= CHECK_CONTEXT && !current) return INVALID_CONTEXT;
  return SUCCESS;
}

static CUresult leave(CUresult rc) {
  pthread_mutex_unlock(&lock);
  return rc;
}

/* The driver's sticky errors (the context is lost), as csrc/cuda_driver.cpp lists them. */
static int sticky(CUresult code) {
  return code == ILLEGAL_ADDRESS || code == 702 || (code >= 714 && code <= LAUNCH_FAILED);
}

static struct range* range_of(uintptr_t address) {
  for (size_t i = 0; i < n_ranges; i++)
    if (address - ranges[i].base < ranges[i].bytes) return &ranges[i];
  return NULL;
}

EXPORT CUresult cuInit(unsigned flags) {
  static int attempted;
  static CUresult result;
  if (flags) return INVALID_VALUE;
  pthread_mutex_lock(&lock);
  if (!attempted) { /* like the driver, the first outcome stays */
    attempted = 1;
    pthread_t thread;
    result = configure();
    if (result == SUCCESS && pthread_create(&thread, NULL, worker, NULL) != 0)
      result = OUT_OF_MEMORY;
    if (result == SUCCESS) pthread_detach(thread);
    initialized = result == SUCCESS;
  }
  return leave(result);
}

EXPORT CUresult cuDriverGetVersion(int* version) { /* works before cuInit, as the driver's */
  if (!version) return INVALID_VALUE;
  pthread_mutex_lock(&lock);
  long long v = driver_version;
  if (!initialized && !env_int("PYSHMCKPT_DOUBLE_DRIVER_VERSION", 12080, &v)) v = driver_version;
  *version = (int)v;
  return leave(SUCCESS);
}

EXPORT CUresult cuDeviceGetCount(int* count) {
  CUresult rc = enter(CHECK_INIT, NULL);
  if (rc) return leave(rc);
  if (!count) return leave(INVALID_VALUE);
  *count = devices;
  return leave(SUCCESS);
}

EXPORT CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  CUresult rc = enter(CHECK_INIT, NULL);
  if (rc) return leave(rc);
  if (!device) return leave(INVALID_VALUE);
  if (ordinal < 0 || ordinal >= devices) return leave(INVALID_DEVICE);
  *device = ordinal;
  return leave(SUCCESS);
}

EXPORT CUresult cuDeviceGetName(char* name, int len, CUdevice device) {
  CUresult rc = enter(CHECK_INIT, NULL);
  if (rc) return leave(rc);
  if (!name || len <= 0) return leave(INVALID_VALUE);
  if (device < 0 || device >= devices) return leave(INVALID_DEVICE);
  snprintf(name, (size_t)len, "pyshmckpt test double %d", device);
  return leave(SUCCESS);
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* context, CUdevice device) {
  CUresult rc = enter(CHECK_INIT, NULL);
  if (rc) return leave(rc);
  if (!context) return leave(INVALID_VALUE);
  if (device < 0 || device >= devices) return leave(INVALID_DEVICE);
  *context = (CUcontext)&contexts[device];
  return leave(SUCCESS);
}

EXPORT CUresult cuCtxGetCurrent(CUcontext* context) {
  CUresult rc = enter(CHECK_INIT, NULL);
  if (rc) return leave(rc);
  if (!context) return leave(INVALID_VALUE);
  *context = current;
  return leave(SUCCESS);
}

EXPORT CUresult cuCtxSetCurrent(CUcontext context) {
  CUresult rc = enter(CHECK_INIT, NULL);
  if (rc) return leave(rc);
  uintptr_t c = (uintptr_t)context, first = (uintptr_t)contexts;
  if (c && (c < first || c >= first + (uintptr_t)devices)) return leave(INVALID_CONTEXT);
  current = context; /* NULL: no current context on this thread */
  return leave(SUCCESS);
}

EXPORT CUresult cuMemHostRegister_v2(void* p, size_t bytes, unsigned flags) {
  CUresult rc = enter(CHECK_CONTEXT, &register_calls);
  if (rc) return leave(rc);
  uintptr_t base = (uintptr_t)p;
  if (!p || bytes == 0 || base + bytes < base || (flags & ~0xFu)) return leave(INVALID_VALUE);
  if (register_calls == fail_register_at) return leave(OUT_OF_MEMORY);
  for (size_t i = 0; i < n_ranges; i++)
    if (base < ranges[i].base + ranges[i].bytes && ranges[i].base < base + bytes)
      return leave(ALREADY_REGISTERED);
  if (!grow((void**)&ranges, &cap_ranges, n_ranges + 1, sizeof *ranges)) return leave(OUT_OF_MEMORY);
  ranges[n_ranges++] = (struct range){base, bytes};
  registered_bytes += bytes;
  return leave(SUCCESS);
}

EXPORT CUresult cuMemHostUnregister(void* p) {
  CUresult rc = enter(CHECK_CONTEXT, &unregister_calls);
  if (rc) return leave(rc);
  for (size_t i = 0; i < n_ranges; i++) {
    if (ranges[i].base != (uintptr_t)p) continue;
    registered_bytes -= ranges[i].bytes;
    ranges[i] = ranges[--n_ranges];
    return leave(SUCCESS);
  }
  return leave(NOT_REGISTERED);
}

/* Appends a copy to the log (`lock` held). */
static void log_copy(void* dst, CUdeviceptr src, size_t bytes) {
  if (grow((void**)&copy_log, &cap_log, 3 * (n_log + 1), sizeof *copy_log)) {
    uint64_t* entry = &copy_log[3 * n_log++];
    entry[0] = (uintptr_t)dst, entry[1] = src, entry[2] = bytes;
  }
}

/* Queues a copy for the worker (`lock` held). */
static CUresult queue_copy(void* dst, CUdeviceptr src, size_t bytes) {
  if (bytes == 0) return SUCCESS;
  struct copy* c = malloc(sizeof *c);
  if (!c) return OUT_OF_MEMORY;
  *c = (struct copy){dst, (const void*)(uintptr_t)src, bytes, NULL};
  if (tail) tail->next = c;
  else head = c;
  tail = c;
  queued++;
  pthread_cond_broadcast(&changed);
  return SUCCESS;
}

EXPORT_COPY CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  (void)stream; /* one queue for all streams: FIFO across streams is a stricter order */
  CUresult rc = enter(CHECK_CONTEXT, &copy_calls);
  if (rc) return leave(rc);
  log_copy(dst, src, bytes);
  if (copy_calls == fail_copy_at) {
    if (sticky(fail_code)) poison = fail_code;
    return leave(fail_code);
  }
  if (!dst || !src) return leave(INVALID_VALUE);
  return leave(queue_copy(dst, src, bytes));
}

EXPORT_BATCH CUresult cuMemcpyBatchAsync_v2(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes,
                                            size_t count, struct memcpy_attributes* attrs,
                                            size_t* attrs_idxs, size_t num_attrs, CUstream stream) {
  CUresult rc = enter(CHECK_CONTEXT, &batch_calls);
  if (rc) return leave(rc);
  if (fail_batch_code) {
    if (sticky(fail_batch_code)) poison = fail_batch_code;
    return leave(fail_batch_code);
  }
  if (!stream || !dsts || !srcs || !sizes || count == 0 || !attrs || !attrs_idxs ||
      num_attrs == 0 || num_attrs > count || attrs_idxs[0] != 0)
    return leave(INVALID_VALUE);
  for (size_t k = 0; k < num_attrs; k++) {
    if (attrs[k].src_access_order < 1 || attrs[k].src_access_order > 3) return leave(INVALID_VALUE);
    if (attrs_idxs[k] >= count || (k > 0 && attrs_idxs[k] <= attrs_idxs[k - 1]))
      return leave(INVALID_VALUE);
  }
  for (size_t i = 0; i < count; i++)
    if (!dsts[i] || !srcs[i]) return leave(INVALID_VALUE);
  for (size_t i = 0; i < count; i++) {
    void* dst = (void*)(uintptr_t)dsts[i];
    log_copy(dst, srcs[i], sizes[i]);
    rc = queue_copy(dst, srcs[i], sizes[i]);
    if (rc) return leave(rc);
  }
  return leave(SUCCESS);
}

EXPORT CUresult cuEventCreate(CUevent* event, unsigned flags) {
  (void)flags; /* timing, blocking sync: nothing to model */
  CUresult rc = enter(CHECK_CONTEXT, NULL);
  if (rc) return leave(rc);
  if (!event) return leave(INVALID_VALUE);
  *event = calloc(1, sizeof **event); /* ticket 0: complete, as an event never recorded */
  return leave(*event ? SUCCESS : OUT_OF_MEMORY);
}

EXPORT CUresult cuEventRecord(CUevent event, CUstream stream) {
  (void)stream;
  CUresult rc = enter(CHECK_CONTEXT, NULL);
  if (rc) return leave(rc);
  if (!event) return leave(INVALID_HANDLE);
  event->ticket = queued;
  return leave(SUCCESS);
}

EXPORT CUresult cuEventQuery(CUevent event) {
  CUresult rc = enter(CHECK_POISON, NULL);
  if (rc) return leave(rc);
  if (!event) return leave(INVALID_HANDLE);
  return leave(done >= event->ticket ? SUCCESS : NOT_READY);
}

EXPORT CUresult cuEventDestroy_v2(CUevent event) {
  CUresult rc = enter(CHECK_POISON, NULL);
  if (rc) return leave(rc);
  if (!event) return leave(INVALID_HANDLE);
  free(event);
  return leave(SUCCESS);
}

EXPORT CUresult cuPointerGetAttribute(void* data, int attribute, CUdeviceptr ptr) {
  CUresult rc = enter(CHECK_POISON, NULL);
  if (rc) return leave(rc);
  if (!data || attribute != MEMORYTYPE_ATTRIBUTE || !range_of((uintptr_t)ptr))
    return leave(INVALID_VALUE);
  *(unsigned*)data = MEMORYTYPE_HOST;
  return leave(SUCCESS);
}

static CUresult describe(CUresult code, const char** out, int text) {
  if (!out) return INVALID_VALUE;
  for (size_t i = 0; i < sizeof ERRORS / sizeof *ERRORS; i++) {
    if (ERRORS[i].code != code) continue;
    *out = text ? ERRORS[i].text : ERRORS[i].name;
    return SUCCESS;
  }
  *out = NULL; /* as the driver does for a code it does not know */
  return INVALID_VALUE;
}

EXPORT CUresult cuGetErrorName(CUresult code, const char** name) { return describe(code, name, 0); }
EXPORT CUresult cuGetErrorString(CUresult code, const char** text) { return describe(code, text, 1); }

/* -- inspection and control for tests ------------------------------------------------------- */

#define GETTER(type, name, value)                 \
  EXPORT type name(void) {                         \
    pthread_mutex_lock(&lock);                     \
    type v = (type)(value);                        \
    pthread_mutex_unlock(&lock);                   \
    return v;                                      \
  }
GETTER(long long, double_register_calls, register_calls)
GETTER(long long, double_unregister_calls, unregister_calls)
GETTER(long long, double_copy_calls, copy_calls)
GETTER(long long, double_batch_calls, batch_calls)
GETTER(long long, double_registered_ranges, n_ranges)
GETTER(size_t, double_registered_bytes, registered_bytes)
GETTER(long long, double_pending_copies, queued - done) /* queued and not run yet */

/* Copies the first min(n, max) (dst, src, bytes) triples into out[3 * max]; returns n, the number
   of copy calls logged since cuInit or double_reset_counters (failed calls included). */
EXPORT int double_copy_log(uint64_t* out, int max) {
  pthread_mutex_lock(&lock);
  size_t n = n_log, take = max > 0 ? (size_t)max : 0;
  if (take > n) take = n;
  if (out && copy_log && take) memcpy(out, copy_log, 3 * take * sizeof *copy_log);
  pthread_mutex_unlock(&lock);
  return (int)n;
}

/* hold != 0: the worker runs no copy until released (a copy already running completes first). */
EXPORT void double_hold_copies(int hold) {
  pthread_mutex_lock(&lock);
  held = hold != 0;
  pthread_cond_broadcast(&changed);
  pthread_mutex_unlock(&lock);
}

/* Zeroes the call counters and the copy log (FAIL_*_AT count from here); keeps registrations,
   queued copies, the hold and any poison. */
EXPORT void double_reset_counters(void) {
  pthread_mutex_lock(&lock);
  register_calls = unregister_calls = copy_calls = batch_calls = 0;
  n_log = 0;
  pthread_mutex_unlock(&lock);
}

/* Reads the PYSHMCKPT_DOUBLE_* variables again, as a first cuInit does, clears any poison and
   resets the counters (registrations, queued copies and the hold are kept), so that one process
   can try several configurations. Returns what a first cuInit would; initialization stays. */
EXPORT CUresult double_reconfigure(void) {
  pthread_mutex_lock(&lock);
  return leave(configure());
}
