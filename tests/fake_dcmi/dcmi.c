/* FAKE libdcmi.so, FOR TESTS ONLY: not Huawei's library and reads no device.
 *
 * The few calls of the Ascend driver's DCMI library that kserve_ascend/server/observability/
 * npu_telemetry.py makes, with the signatures, units and return codes of Huawei's DCMI API
 * reference (hiascend.com, Atlas 200I A2 "DCMI API参考", re/api: api_008 dcmi_get_card_list,
 * api_020 dcmi_get_device_power_info, api_024 dcmi_get_device_health, api_040
 * dcmi_get_device_temperature, api_176 the calling example, api_177 the return codes) and of the
 * header the driver installs (dcmi_interface_api.h, as Ascend/ascend-npu-exporter carries it in
 * devmanager/dcmi/, which also calls dcmi_get_device_num_in_card and dcmi_get_device_logic_id):
 *   int dcmi_init(void)
 *   int dcmi_get_card_list(int *card_num, int *card_list, int list_len)
 *   int dcmi_get_device_num_in_card(int card_id, int *device_num)
 *   int dcmi_get_device_logic_id(int *device_logic_id, int card_id, int device_id)
 *   int dcmi_get_device_temperature(int card_id, int device_id, int *temperature)   degrees Celsius
 *   int dcmi_get_device_power_info(int card_id, int device_id, int *power)          units of 0.1 W
 *   int dcmi_get_device_health(int card_id, int device_id, unsigned int *health)
 *       0 normal, 1 general (minor) alarm, 2 major alarm, 3 critical alarm, 0xFFFFFFFF no such device
 * Each returns 0 (DCMI_OK) or a negative DCMI code: -8001 DCMI_ERR_CODE_INVALID_PARAMETER (here: a
 * null pointer, a list too short), -8007 DCMI_ERR_CODE_INVALID_DEVICE_ID (a card or chip the
 * machine lacks). The reference's example calls dcmi_init before anything else but names no code
 * for a call made before it: here such a call answers -8005 DCMI_ERR_CODE_INNER_ERR.
 *
 * The machine is a text file named by the environment variable FAKE_DCMI_STATE, read at every
 * call (so a test changes the readings by rewriting it, whole, by a rename), one line each:
 *   npu <card_id> <device_id> <logic_id> <temperature_celsius> <power_in_0.1_W> <health>
 *   error <function> <card_id> <device_id> <code>    that call returns <code> for that chip
 *                                                    (-1 for card and device: every call of it)
 *   hold <function>     that call waits (as a driver call that takes long) while the line is there,
 *                       having created the file <FAKE_DCMI_STATE>.held to say it does
 * No file, or no npu line: a machine without NPUs (dcmi_get_card_list answers 0 cards).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DCMI_OK 0
#define DCMI_ERR_CODE_INVALID_PARAMETER (-8001)
#define DCMI_ERR_CODE_INNER_ERR (-8005)
#define DCMI_ERR_CODE_INVALID_DEVICE_ID (-8007)
#define MAX_NPUS 64

struct npu {
    int card, device, logic, temperature, power;
    unsigned int health;
};

static struct npu npus[MAX_NPUS];
static int npu_count;
static int initialized;
static int held; /* set by load: a `hold` line names the function */

/* Reads the state file; returns the code an `error` line sets for (function, card, device), else 0. */
static int load(const char *function, int card, int device) {
    const char *path = getenv("FAKE_DCMI_STATE");
    FILE *file = path ? fopen(path, "r") : NULL;
    char line[256], name[64];
    int code = 0;
    npu_count = held = 0;
    if (!file) return 0;
    while (fgets(line, sizeof line, file)) {
        struct npu n;
        int error_card, error_device, error_code;
        if (npu_count < MAX_NPUS && sscanf(line, "npu %d %d %d %d %d %u", &n.card, &n.device, &n.logic,
                                           &n.temperature, &n.power, &n.health) == 6) {
            npus[npu_count++] = n;
        } else if (sscanf(line, "error %63s %d %d %d", name, &error_card, &error_device, &error_code) == 4
                   && strcmp(name, function) == 0
                   && (error_card == -1 || (error_card == card && error_device == device))) {
            code = error_code;
        } else if (sscanf(line, "hold %63s", name) == 1 && strcmp(name, function) == 0) {
            held = 1;
        }
    }
    fclose(file);
    return code;
}

/* The chip (card, device), or NULL. */
static struct npu *find(int card, int device) {
    for (int i = 0; i < npu_count; i++)
        if (npus[i].card == card && npus[i].device == device) return &npus[i];
    return NULL;
}

/* What every per-chip call checks first; 0 and *found set when it may answer. */
static int begin(const char *function, int card, int device, const void *out, struct npu **found) {
    if (!initialized) return DCMI_ERR_CODE_INNER_ERR;
    int code = load(function, card, device);
    if (held) {
        char marker[4096];
        snprintf(marker, sizeof marker, "%s.held", getenv("FAKE_DCMI_STATE"));
        FILE *file = fopen(marker, "w");
        if (file) fclose(file);
        while (held) {
            usleep(10000);
            code = load(function, card, device);
        }
    }
    if (code) return code;
    if (!out) return DCMI_ERR_CODE_INVALID_PARAMETER;
    *found = find(card, device);
    return *found ? DCMI_OK : DCMI_ERR_CODE_INVALID_DEVICE_ID;
}

int dcmi_init(void) {
    int code = load("dcmi_init", -1, -1);
    if (code) return code;
    initialized = 1;
    return DCMI_OK;
}

int dcmi_get_card_list(int *card_num, int *card_list, int list_len) {
    if (!initialized) return DCMI_ERR_CODE_INNER_ERR;
    int code = load("dcmi_get_card_list", -1, -1);
    if (code) return code;
    if (!card_num || !card_list) return DCMI_ERR_CODE_INVALID_PARAMETER;
    int cards = 0;
    for (int i = 0; i < npu_count; i++) {
        int seen = 0;
        for (int j = 0; j < i; j++) seen |= npus[j].card == npus[i].card;
        if (seen) continue;
        if (cards == list_len) return DCMI_ERR_CODE_INVALID_PARAMETER;
        card_list[cards++] = npus[i].card;
    }
    *card_num = cards;
    return DCMI_OK;
}

int dcmi_get_device_num_in_card(int card_id, int *device_num) {
    if (!initialized) return DCMI_ERR_CODE_INNER_ERR;
    int code = load("dcmi_get_device_num_in_card", card_id, -1);
    if (code) return code;
    if (!device_num) return DCMI_ERR_CODE_INVALID_PARAMETER;
    int count = 0;
    for (int i = 0; i < npu_count; i++) count += npus[i].card == card_id;
    if (!count) return DCMI_ERR_CODE_INVALID_DEVICE_ID;
    *device_num = count;
    return DCMI_OK;
}

int dcmi_get_device_logic_id(int *device_logic_id, int card_id, int device_id) {
    struct npu *n;
    int code = begin("dcmi_get_device_logic_id", card_id, device_id, device_logic_id, &n);
    if (code == DCMI_OK) *device_logic_id = n->logic;
    return code;
}

int dcmi_get_device_temperature(int card_id, int device_id, int *temperature) {
    struct npu *n;
    int code = begin("dcmi_get_device_temperature", card_id, device_id, temperature, &n);
    if (code == DCMI_OK) *temperature = n->temperature;
    return code;
}

int dcmi_get_device_power_info(int card_id, int device_id, int *power) {
    struct npu *n;
    int code = begin("dcmi_get_device_power_info", card_id, device_id, power, &n);
    if (code == DCMI_OK) *power = n->power;
    return code;
}

int dcmi_get_device_health(int card_id, int device_id, unsigned int *health) {
    struct npu *n;
    int code = begin("dcmi_get_device_health", card_id, device_id, health, &n);
    if (code == DCMI_OK) *health = n->health;
    return code;
}
