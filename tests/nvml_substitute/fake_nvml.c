/*
 * A small stand-in for NVIDIA's libnvidia-ml.so.1, for tests only.
 *
 * It exports a handful of NVML entry points with the exact C signatures of nvml.h, so the
 * unchanged `pynvml` bindings (nvidia-ml-py) load it through ctypes exactly as they would load
 * the real library. The behaviour is chosen by MODELFORGE_FAKE_NVML_SCENARIO, read when NVML is
 * initialised (see tests/nvml_substitute/__init__.py for the values and the expected data):
 *
 *   healthy (default)  two GPUs with fixed telemetry
 *   no_devices         init succeeds, zero GPUs
 *   telemetry_fail     two GPUs are enumerated, but utilisation, temperature and power usage
 *                      return NVML_ERROR_UNKNOWN
 *   init_fail          every nvmlInit* returns NVML_ERROR_DRIVER_NOT_LOADED
 *
 * Any other value makes nvmlInit* fail with NVML_ERROR_UNKNOWN and a message on stderr.
 * Every function except nvmlErrorString returns NVML_ERROR_UNINITIALIZED before a successful
 * init.
 *
 * Faults are injected while a process runs through the control file named by
 * MODELFORGE_FAKE_NVML_CONTROL (read at the first successful init; unset, or a file that does not
 * exist yet: no faults). Tests append whole lines to it; each process keeps its own read offset
 * and reads the new complete lines at nvmlInit, at every device query and every ~5 ms while
 * nvmlEventSetWait waits. The lines (index = NVML device index):
 *
 *   xid <index> <code>             queued to the event sets registered for
 *                                  nvmlEventTypeXidCriticalError on that GPU when it is read
 *   lost <index> / found <index>   every per-device call returns NVML_ERROR_GPU_IS_LOST / not
 *   ecc <index> corrected|uncorrected volatile|aggregate <count>
 *                                  sets that counter; nvmlDeviceGetTotalEccErrors answers
 *                                  NVML_ERROR_NOT_SUPPORTED on a GPU until a line sets one of
 *                                  its counters (the others then read 0)
 *   remap <index> <corrected> <uncorrected> <pending 0|1> <failure 0|1>
 *   retired_pending <index> 0|1
 *   throttle <index> <mask>        the current clocks event (throttle) reasons, decimal or 0x hex
 *   reset <index>                  a GPU reset: clears lost, volatile ECC counters, the pending
 *                                  remap and retired pages, throttle; aggregate counters, remapped
 *                                  row counts and a remap failure stay
 *
 * A malformed line (or one longer than 255 bytes) is ignored with one message on stderr; a last
 * line without its newline is read once the newline is there. The state lines apply in every process
 * that reads them. The device count keeps counting a lost GPU, handle lookup by index answers
 * GPU_IS_LOST for it (as real NVML does), and nvmlEventSetWait, not a per-device call, keeps
 * working. One recursive mutex guards
 * all state, so one thread may wait on an event set while others query devices.
 *
 * Build: gcc -shared -fPIC -pthread -O2 -Wall -Wextra -Werror -o libnvidia-ml.so.1 fake_nvml.c
 */
#define _GNU_SOURCE /* PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- Types and codes, as in nvml.h ---- */

typedef enum nvmlReturn_enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999
} nvmlReturn_t;

typedef enum nvmlTemperatureSensors_enum {
    NVML_TEMPERATURE_GPU = 0
} nvmlTemperatureSensors_t;

typedef enum nvmlMemoryErrorType_enum {
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0,
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
} nvmlMemoryErrorType_t;

typedef enum nvmlEccCounterType_enum {
    NVML_VOLATILE_ECC = 0,
    NVML_AGGREGATE_ECC = 1
} nvmlEccCounterType_t;

typedef enum nvmlEnableState_enum {
    NVML_FEATURE_DISABLED = 0,
    NVML_FEATURE_ENABLED = 1
} nvmlEnableState_t;

typedef struct nvmlMemory_st {
    unsigned long long total; /* bytes */
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct nvmlMemory_v2_st {
    unsigned int version;
    unsigned long long total; /* bytes */
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef struct nvmlUtilization_st {
    unsigned int gpu;    /* percent */
    unsigned int memory; /* percent */
} nvmlUtilization_t;

typedef struct nvmlTemperature_v1_st {
    unsigned int version;
    nvmlTemperatureSensors_t sensorType;
    int temperature; /* degrees C */
} nvmlTemperature_v1_t;
typedef nvmlTemperature_v1_t nvmlTemperature_t;

#define NVML_STRUCT_VERSION(data, ver) \
    (unsigned int)(sizeof(nvml##data##_v##ver##_t) | ((unsigned int)(ver) << 24U))
#define nvmlMemory_v2 NVML_STRUCT_VERSION(Memory, 2)           /* 0x02000028 */
#define nvmlTemperature_v1 NVML_STRUCT_VERSION(Temperature, 1) /* 0x0100000C */

/* In nvml.h the handle is an opaque pointer; here it points at the device's fixed data. */
typedef struct nvmlDevice_st {
    unsigned int index;
    const char *uuid;
    unsigned long long memory_total_mib;
    unsigned long long memory_used_mib;
    unsigned int util_gpu, util_memory; /* percent */
    unsigned int temperature_c;
    unsigned int power_usage_mw, power_limit_mw;
} *nvmlDevice_t;

typedef struct nvmlEventSet_st *nvmlEventSet_t;

typedef struct nvmlEventData_st {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;        /* the XID code for nvmlEventTypeXidCriticalError */
    unsigned int gpuInstanceId;          /* 0xFFFFFFFF without MIG (added with _v2) */
    unsigned int computeInstanceId;
} nvmlEventData_t;

#define nvmlEventTypeSingleBitEccError 0x0000000000000001ULL
#define nvmlEventTypeDoubleBitEccError 0x0000000000000002ULL
#define nvmlEventTypePState 0x0000000000000004ULL
#define nvmlEventTypeXidCriticalError 0x0000000000000008ULL
#define nvmlEventTypeClock 0x0000000000000010ULL
/* What a data-centre GPU reports as supported; only XID events are ever generated here. */
#define SUPPORTED_EVENT_TYPES                                                                   \
    (nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError | nvmlEventTypePState |  \
     nvmlEventTypeXidCriticalError | nvmlEventTypeClock)
#define NO_INSTANCE 0xFFFFFFFFU

/* ---- Scenario data ---- */

#define MIB (1024ULL * 1024ULL)
#define DEVICE_NAME "NVIDIA Fake H200"
#define DRIVER_VERSION "560.35.03"
#define NVML_VERSION "12.560.35.03"
#define CUDA_DRIVER_VERSION 12060

static struct nvmlDevice_st devices[] = {
    {0, "GPU-11111111-2222-3333-4444-555555555555", 143771, 1024, 37, 12, 41, 120500, 700000},
    {1, "GPU-66666666-7777-8888-9999-000000000000", 143771, 2048, 61, 20, 55, 250250, 700000},
};
#define DEVICE_SLOTS (sizeof(devices) / sizeof(devices[0]))

enum scenario { HEALTHY, NO_DEVICES, TELEMETRY_FAIL, INIT_FAIL };

static enum scenario scenario = HEALTHY;
static unsigned int init_count = 0; /* NVML reference-counts init/shutdown */
static unsigned int device_count = 0;

static int read_scenario(enum scenario *out)
{
    const char *name = getenv("MODELFORGE_FAKE_NVML_SCENARIO");

    if (name == NULL || name[0] == '\0' || strcmp(name, "healthy") == 0)
        *out = HEALTHY;
    else if (strcmp(name, "no_devices") == 0)
        *out = NO_DEVICES;
    else if (strcmp(name, "telemetry_fail") == 0)
        *out = TELEMETRY_FAIL;
    else if (strcmp(name, "init_fail") == 0)
        *out = INIT_FAIL;
    else {
        fprintf(stderr,
                "fake NVML: unknown MODELFORGE_FAKE_NVML_SCENARIO '%s' "
                "(expected healthy, no_devices, telemetry_fail or init_fail)\n",
                name);
        return 0;
    }
    return 1;
}

/* ---- Locking ---- */

/* Recursive: public entry points call each other (nvmlInit_v2 -> nvmlInitWithFlags ...). */
static pthread_mutex_t state_lock = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;

static int lock_state(void)
{
    pthread_mutex_lock(&state_lock);
    return 1;
}

static void unlock_state(int *held)
{
    if (*held)
        pthread_mutex_unlock(&state_lock);
}

/* Holds the state lock until the enclosing function returns. */
#define GUARD_STATE() \
    int state_guard __attribute__((cleanup(unlock_state), unused)) = lock_state()

/* ---- Injected faults ---- */

struct faults {
    int lost;
    int ecc_supported;              /* a control line set one of this GPU's ECC counters */
    unsigned long long ecc[2][2];   /* [nvmlMemoryErrorType_t][nvmlEccCounterType_t] */
    unsigned int remap_corrected, remap_uncorrected, remap_pending, remap_failure;
    nvmlEnableState_t retired_pending;
    unsigned long long throttle;    /* clocks event reasons */
};

static struct faults faults[DEVICE_SLOTS];

#define EVENT_QUEUE_SLOTS 256

struct queued_event {
    unsigned int device;
    unsigned long long code;
};

struct nvmlEventSet_st {
    unsigned long long registered[DEVICE_SLOTS]; /* event types, per device */
    struct queued_event queue[EVENT_QUEUE_SLOTS];
    unsigned int head, count;
    struct nvmlEventSet_st *next;
};

static struct nvmlEventSet_st *event_sets = NULL; /* every live set */

static int live_set(const struct nvmlEventSet_st *set)
{
    for (const struct nvmlEventSet_st *s = event_sets; s != NULL; s = s->next)
        if (s == set)
            return 1;
    return 0;
}

static void queue_xid(unsigned int device, unsigned long long code)
{
    for (struct nvmlEventSet_st *s = event_sets; s != NULL; s = s->next) {
        if (!(s->registered[device] & nvmlEventTypeXidCriticalError))
            continue;
        if (s->count == EVENT_QUEUE_SLOTS) {
            fprintf(stderr, "fake NVML: event set %p is full, dropping XID %llu on GPU %u\n",
                    (void *)s, code, device);
            continue;
        }
        s->queue[(s->head + s->count) % EVENT_QUEUE_SLOTS] = (struct queued_event){device, code};
        s->count++;
    }
}

/* ---- The control file ---- */

#define CONTROL_LINE_MAX 256

static char *control_path = NULL; /* MODELFORGE_FAKE_NVML_CONTROL, read at the first init */
static int control_fd = -1;
static off_t control_offset = 0;   /* this process's read position */
static int control_skipping = 0;   /* inside a line longer than CONTROL_LINE_MAX */

static int parse_number(const char *text, int base, unsigned long long max,
                        unsigned long long *out)
{
    char *end;
    unsigned long long value;

    if (text == NULL || text[0] < '0' || text[0] > '9')
        return 0;
    errno = 0;
    value = strtoull(text, &end, base);
    if (errno != 0 || *end != '\0' || value > max)
        return 0;
    *out = value;
    return 1;
}

/* Applies one line; returns 0 when it is malformed. */
static int apply_control_line(char *line)
{
    char *words[8], *save = NULL;
    unsigned int n = 0;
    unsigned long long index, a, b, c, d;
    struct faults *f;

    for (char *w = strtok_r(line, " \t\r", &save); w != NULL; w = strtok_r(NULL, " \t\r", &save)) {
        if (n == sizeof(words) / sizeof(words[0]))
            return 0;
        words[n++] = w;
    }
    if (n == 0 || words[0][0] == '#')
        return 1; /* blank line or comment */
    if (n < 2 || !parse_number(words[1], 10, device_count == 0 ? 0 : device_count - 1, &index) ||
        device_count == 0)
        return 0;
    f = &faults[index];

    if (strcmp(words[0], "xid") == 0 && n == 3 && parse_number(words[2], 10, 0xFFFFFFFFULL, &a))
        queue_xid((unsigned int)index, a);
    else if (strcmp(words[0], "lost") == 0 && n == 2)
        f->lost = 1;
    else if (strcmp(words[0], "found") == 0 && n == 2)
        f->lost = 0;
    else if (strcmp(words[0], "ecc") == 0 && n == 5 &&
             (strcmp(words[2], "corrected") == 0 || strcmp(words[2], "uncorrected") == 0) &&
             (strcmp(words[3], "volatile") == 0 || strcmp(words[3], "aggregate") == 0) &&
             parse_number(words[4], 10, ~0ULL, &a)) {
        f->ecc[strcmp(words[2], "uncorrected") == 0][strcmp(words[3], "aggregate") == 0] = a;
        f->ecc_supported = 1;
    } else if (strcmp(words[0], "remap") == 0 && n == 6 &&
               parse_number(words[2], 10, 0xFFFFFFFFULL, &a) &&
               parse_number(words[3], 10, 0xFFFFFFFFULL, &b) && parse_number(words[4], 10, 1, &c) &&
               parse_number(words[5], 10, 1, &d)) {
        f->remap_corrected = (unsigned int)a;
        f->remap_uncorrected = (unsigned int)b;
        f->remap_pending = (unsigned int)c;
        f->remap_failure = (unsigned int)d;
    } else if (strcmp(words[0], "retired_pending") == 0 && n == 3 &&
               parse_number(words[2], 10, 1, &a))
        f->retired_pending = a ? NVML_FEATURE_ENABLED : NVML_FEATURE_DISABLED;
    else if (strcmp(words[0], "throttle") == 0 && n == 3 && parse_number(words[2], 0, ~0ULL, &a))
        f->throttle = a;
    else if (strcmp(words[0], "reset") == 0 && n == 2) {
        f->lost = 0;
        f->ecc[NVML_MEMORY_ERROR_TYPE_CORRECTED][NVML_VOLATILE_ECC] = 0;
        f->ecc[NVML_MEMORY_ERROR_TYPE_UNCORRECTED][NVML_VOLATILE_ECC] = 0;
        f->remap_pending = 0;
        f->retired_pending = NVML_FEATURE_DISABLED;
        f->throttle = 0;
    } else
        return 0;
    return 1;
}

static void reject_control_line(const char *line)
{
    fprintf(stderr,
            "fake NVML: ignoring malformed line '%.*s' in %s (expected xid, lost, found, ecc, "
            "remap, retired_pending, throttle or reset with a GPU index below %u; see "
            "tests/nvml_substitute/__init__.py)\n",
            CONTROL_LINE_MAX, line, control_path, device_count);
}

/* Reads and applies the complete lines appended since the last call. Hold the state lock. */
static void read_control(void)
{
    char buf[CONTROL_LINE_MAX + 1], copy[CONTROL_LINE_MAX + 1];

    if (control_path == NULL)
        return;
    if (control_fd < 0) {
        control_fd = open(control_path, O_RDONLY | O_CLOEXEC);
        if (control_fd < 0)
            return; /* not written yet */
    }
    for (;;) {
        ssize_t got = pread(control_fd, buf, CONTROL_LINE_MAX, control_offset);
        size_t start = 0;

        if (got <= 0)
            return;
        for (size_t i = 0; i < (size_t)got; i++) {
            if (buf[i] != '\n')
                continue;
            buf[i] = '\0';
            if (control_skipping)
                control_skipping = 0; /* the end of an over-long line, already reported */
            else {
                memcpy(copy, buf + start, i - start + 1);
                if (!apply_control_line(buf + start))
                    reject_control_line(copy);
            }
            start = i + 1;
        }
        if (start == 0) {
            if (got < CONTROL_LINE_MAX)
                return; /* a line still being written */
            buf[got] = '\0';
            if (!control_skipping)
                reject_control_line(buf);
            control_skipping = 1;
            start = (size_t)got;
        }
        control_offset += (off_t)start;
        if (got < CONTROL_LINE_MAX)
            return; /* the end of the file, or of what is written of its last line */
    }
}

static void open_control(void)
{
    const char *path = getenv("MODELFORGE_FAKE_NVML_CONTROL");

    if (control_path == NULL && path != NULL && path[0] != '\0') {
        control_path = strdup(path);
        if (control_path == NULL)
            fprintf(stderr, "fake NVML: out of memory, ignoring the control file\n");
    }
}

/* ---- Helpers ---- */

/* Hold the state lock. Reads the control file first: a query sees every line written before. */
static nvmlReturn_t check_device(nvmlDevice_t device, const void *out)
{
    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    read_control();
    if (out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < device_count; i++)
        if (device == &devices[i])
            return faults[i].lost ? NVML_ERROR_GPU_IS_LOST : NVML_SUCCESS;
    return NVML_ERROR_INVALID_ARGUMENT; /* not a handle this library handed out */
}

static nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src)
{
    if (dst == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* ---- Initialisation ---- */

nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    GUARD_STATE();
    (void)flags;
    if (init_count == 0) {
        if (!read_scenario(&scenario))
            return NVML_ERROR_UNKNOWN;
        if (scenario == INIT_FAIL)
            return NVML_ERROR_DRIVER_NOT_LOADED;
        device_count = scenario == NO_DEVICES ? 0 : (unsigned int)DEVICE_SLOTS;
        open_control();
    }
    init_count++;
    read_control();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
    GUARD_STATE();
    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    init_count--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument Version Mismatch";
    default: return "Unknown Error";
    }
}

/* ---- System queries ---- */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    GUARD_STATE();
    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    return copy_string(version, length, DRIVER_VERSION);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    GUARD_STATE();
    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    return copy_string(version, length, NVML_VERSION);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
    GUARD_STATE();
    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (cudaDriverVersion == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *cudaDriverVersion = CUDA_DRIVER_VERSION; /* 1000 * major + 10 * minor */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion)
{
    return nvmlSystemGetCudaDriverVersion(cudaDriverVersion);
}

/* ---- Device enumeration ---- */

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)
{
    GUARD_STATE();
    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    read_control();
    if (deviceCount == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    *deviceCount = device_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *deviceCount)
{
    return nvmlDeviceGetCount_v2(deviceCount);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    GUARD_STATE();
    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    read_control();
    if (device == NULL || index >= device_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* As real NVML: a GPU that fell off the bus has no handle to look up (one looked up before
     * stays a handle, and every call on it answers GPU_IS_LOST). */
    if (faults[index].lost)
        return NVML_ERROR_GPU_IS_LOST;
    *device = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device)
{
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

/* ---- Device identity and memory ---- */

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_device(device, uuid);
    return ret != NVML_SUCCESS ? ret : copy_string(uuid, length, device->uuid);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_device(device, name);
    return ret != NVML_SUCCESS ? ret : copy_string(name, length, DEVICE_NAME);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_device(device, index);
    if (ret == NVML_SUCCESS)
        *index = device->index;
    return ret;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_device(device, memory);
    if (ret == NVML_SUCCESS) {
        memory->total = device->memory_total_mib * MIB;
        memory->used = device->memory_used_mib * MIB;
        memory->free = memory->total - memory->used;
    }
    return ret;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_device(device, memory);
    if (ret != NVML_SUCCESS)
        return ret;
    if (memory->version != nvmlMemory_v2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->total = device->memory_total_mib * MIB;
    memory->reserved = 0;
    memory->used = device->memory_used_mib * MIB;
    memory->free = memory->total - memory->used;
    return NVML_SUCCESS;
}

/* ---- Telemetry (fails in the telemetry_fail scenario) ---- */

static nvmlReturn_t check_telemetry(nvmlDevice_t device, const void *out)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_device(device, out);
    if (ret == NVML_SUCCESS && scenario == TELEMETRY_FAIL)
        return NVML_ERROR_UNKNOWN;
    return ret;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_telemetry(device, utilization);
    if (ret == NVML_SUCCESS) {
        utilization->gpu = device->util_gpu;
        utilization->memory = device->util_memory;
    }
    return ret;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, nvmlTemperatureSensors_t sensorType,
                                      unsigned int *temp)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_telemetry(device, temp);
    if (ret != NVML_SUCCESS)
        return ret;
    if (sensorType != NVML_TEMPERATURE_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    *temp = device->temperature_c;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t device, nvmlTemperature_t *temperature)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_telemetry(device, temperature);
    if (ret != NVML_SUCCESS)
        return ret;
    if (temperature->version != nvmlTemperature_v1)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (temperature->sensorType != NVML_TEMPERATURE_GPU)
        return NVML_ERROR_INVALID_ARGUMENT;
    temperature->temperature = (int)device->temperature_c;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_telemetry(device, power);
    if (ret == NVML_SUCCESS)
        *power = device->power_usage_mw;
    return ret;
}

/* ---- Limits, ECC and clock reasons ---- */

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_device(device, limit);
    if (ret == NVML_SUCCESS)
        *limit = device->power_limit_mw;
    return ret;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                         nvmlEccCounterType_t counterType,
                                         unsigned long long *eccCounts)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_device(device, eccCounts);
    const struct faults *f;

    if (ret != NVML_SUCCESS)
        return ret;
    f = &faults[device->index];
    if (!f->ecc_supported)
        return NVML_ERROR_NOT_SUPPORTED; /* until a control line sets a counter on this GPU */
    if ((errorType != NVML_MEMORY_ERROR_TYPE_CORRECTED &&
         errorType != NVML_MEMORY_ERROR_TYPE_UNCORRECTED) ||
        (counterType != NVML_VOLATILE_ECC && counterType != NVML_AGGREGATE_ECC))
        return NVML_ERROR_INVALID_ARGUMENT;
    *eccCounts = f->ecc[errorType][counterType];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                    unsigned long long *clocksEventReasons)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_device(device, clocksEventReasons);
    if (ret == NVML_SUCCESS)
        *clocksEventReasons = faults[device->index].throttle; /* 0 (none) unless injected */
    return ret;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                       unsigned long long *clocksThrottleReasons)
{
    return nvmlDeviceGetCurrentClocksEventReasons(device, clocksThrottleReasons);
}

/* ---- Row remapping and page retirement ---- */

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                       unsigned int *uncRows, unsigned int *isPending,
                                       unsigned int *failureOccurred)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_device(device, corrRows);
    const struct faults *f;

    if (ret != NVML_SUCCESS)
        return ret;
    if (uncRows == NULL || isPending == NULL || failureOccurred == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    f = &faults[device->index];
    *corrRows = f->remap_corrected;
    *uncRows = f->remap_uncorrected;
    *isPending = f->remap_pending;
    *failureOccurred = f->remap_failure;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device,
                                                    nvmlEnableState_t *isPending)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_device(device, isPending);
    if (ret == NVML_SUCCESS)
        *isPending = faults[device->index].retired_pending;
    return ret;
}

/* ---- Events ---- */

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set)
{
    GUARD_STATE();
    struct nvmlEventSet_st *created;

    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (set == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    created = calloc(1, sizeof(*created));
    if (created == NULL)
        return NVML_ERROR_MEMORY;
    created->next = event_sets;
    event_sets = created;
    *set = created;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device, unsigned long long *eventTypes)
{
    GUARD_STATE();
    nvmlReturn_t ret = check_device(device, eventTypes);
    if (ret == NVML_SUCCESS)
        *eventTypes = SUPPORTED_EVENT_TYPES;
    return ret;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                      nvmlEventSet_t set)
{
    GUARD_STATE();
    /* Lines read here, before the registration, are not delivered to this set. */
    nvmlReturn_t ret = check_device(device, set);

    if (ret != NVML_SUCCESS)
        return ret;
    if (!live_set(set))
        return NVML_ERROR_INVALID_ARGUMENT;
    if (eventTypes & ~SUPPORTED_EVENT_TYPES)
        return NVML_ERROR_NOT_SUPPORTED;
    set->registered[device->index] |= eventTypes;
    return NVML_SUCCESS;
}

#define EVENT_POLL_NS 5000000L /* 5 ms between reads of the control file while waiting */

/* In nanoseconds: whole milliseconds rounded the nanoseconds' part toward zero, so a wait
 * could end up to 1 ms before its timeout (a 50 ms wait measured 49.5 ms). */
static long long elapsed_ns(const struct timespec *since)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (long long)(now.tv_sec - since->tv_sec) * 1000000000LL +
           (now.tv_nsec - since->tv_nsec);
}

/* Takes the oldest queued event, or says why there is none; 1 when `data` was filled. */
static int take_event(nvmlEventSet_t set, nvmlEventData_t *data, int with_instances,
                      nvmlReturn_t *ret)
{
    GUARD_STATE();
    struct queued_event event;

    if (init_count == 0) {
        *ret = NVML_ERROR_UNINITIALIZED;
        return 0;
    }
    if (data == NULL || !live_set(set)) {
        *ret = NVML_ERROR_INVALID_ARGUMENT;
        return 0;
    }
    read_control();
    *ret = NVML_ERROR_TIMEOUT;
    if (set->count == 0)
        return 0;
    event = set->queue[set->head];
    set->head = (set->head + 1) % EVENT_QUEUE_SLOTS;
    set->count--;
    data->device = &devices[event.device];
    data->eventType = nvmlEventTypeXidCriticalError;
    data->eventData = event.code;
    if (with_instances) { /* the v1 struct ends before these fields */
        data->gpuInstanceId = NO_INSTANCE;
        data->computeInstanceId = NO_INSTANCE;
    }
    *ret = NVML_SUCCESS;
    return 1;
}

/* Polls without holding the lock between reads, so other threads' queries go on meanwhile. */
static nvmlReturn_t wait_event(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms,
                               int with_instances)
{
    struct timespec start;
    nvmlReturn_t ret;

    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        long long left;
        struct timespec pause = {0, EVENT_POLL_NS};

        if (take_event(set, data, with_instances, &ret) || ret != NVML_ERROR_TIMEOUT)
            return ret;
        left = (long long)timeoutms * 1000000LL - elapsed_ns(&start);
        if (left <= 0)
            return NVML_ERROR_TIMEOUT;
        if (left < pause.tv_nsec)
            pause.tv_nsec = (long)left;
        nanosleep(&pause, NULL);
    }
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return wait_event(set, data, timeoutms, 1);
}

nvmlReturn_t nvmlEventSetWait(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return wait_event(set, data, timeoutms, 0);
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set)
{
    GUARD_STATE();

    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    for (struct nvmlEventSet_st **link = &event_sets; *link != NULL; link = &(*link)->next)
        if (*link == set) {
            *link = set->next;
            free(set);
            return NVML_SUCCESS;
        }
    return NVML_ERROR_INVALID_ARGUMENT;
}
