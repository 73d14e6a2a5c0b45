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
 * init. ECC counters are always NVML_ERROR_NOT_SUPPORTED. Not thread-safe: tests are serial.
 *
 * Build: gcc -shared -fPIC -O2 -Wall -Wextra -Werror -o libnvidia-ml.so.1 fake_nvml.c
 */
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

/* ---- Helpers ---- */

static nvmlReturn_t check_device(nvmlDevice_t device, const void *out)
{
    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (out == NULL)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < device_count; i++)
        if (device == &devices[i])
            return NVML_SUCCESS;
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
    (void)flags;
    if (init_count == 0) {
        if (!read_scenario(&scenario))
            return NVML_ERROR_UNKNOWN;
        if (scenario == INIT_FAIL)
            return NVML_ERROR_DRIVER_NOT_LOADED;
        device_count = scenario == NO_DEVICES ? 0 : (unsigned int)DEVICE_SLOTS;
    }
    init_count++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void)
{
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
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument Version Mismatch";
    default: return "Unknown Error";
    }
}

/* ---- System queries ---- */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    return copy_string(version, length, DRIVER_VERSION);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    return copy_string(version, length, NVML_VERSION);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion)
{
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
    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
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
    if (init_count == 0)
        return NVML_ERROR_UNINITIALIZED;
    if (device == NULL || index >= device_count)
        return NVML_ERROR_INVALID_ARGUMENT;
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
    nvmlReturn_t ret = check_device(device, uuid);
    return ret != NVML_SUCCESS ? ret : copy_string(uuid, length, device->uuid);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    nvmlReturn_t ret = check_device(device, name);
    return ret != NVML_SUCCESS ? ret : copy_string(name, length, DEVICE_NAME);
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index)
{
    nvmlReturn_t ret = check_device(device, index);
    if (ret == NVML_SUCCESS)
        *index = device->index;
    return ret;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
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
    nvmlReturn_t ret = check_device(device, out);
    if (ret == NVML_SUCCESS && scenario == TELEMETRY_FAIL)
        return NVML_ERROR_UNKNOWN;
    return ret;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization)
{
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
    nvmlReturn_t ret = check_telemetry(device, power);
    if (ret == NVML_SUCCESS)
        *power = device->power_usage_mw;
    return ret;
}

/* ---- Limits, ECC and clock reasons ---- */

nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t device, unsigned int *limit)
{
    nvmlReturn_t ret = check_device(device, limit);
    if (ret == NVML_SUCCESS)
        *limit = device->power_limit_mw;
    return ret;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, nvmlMemoryErrorType_t errorType,
                                         nvmlEccCounterType_t counterType,
                                         unsigned long long *eccCounts)
{
    nvmlReturn_t ret = check_device(device, eccCounts);
    (void)errorType;
    (void)counterType;
    return ret != NVML_SUCCESS ? ret : NVML_ERROR_NOT_SUPPORTED;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                    unsigned long long *clocksEventReasons)
{
    nvmlReturn_t ret = check_device(device, clocksEventReasons);
    if (ret == NVML_SUCCESS)
        *clocksEventReasons = 0ULL; /* no throttling */
    return ret;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                       unsigned long long *clocksThrottleReasons)
{
    return nvmlDeviceGetCurrentClocksEventReasons(device, clocksThrottleReasons);
}
