/* RMSNorm rows on the CPU, optionally after the residual add (norm.py has the formula).
 *
 * torch's bf16 rms_norm on a [1, 1024] row dispatches half a dozen operators (20-35 us on a
 * decode step); this is one call of about a microsecond plus ctypes. Arithmetic as torch's:
 * the residual sum rounded to the activation dtype, statistics in fp32, out = v * rstd * w in
 * fp32 rounded once. Activations fp32 or bf16; the weight in the activation dtype or fp32, one
 * row for all, or one per head (row r uses weight row r % w_rows).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_common.h"

#define LANES 16 /* partial sums, so the square sum vectorizes without reassociation flags */

void thr_rms_norm(const void *x, const void *res, void *res_out, const void *w, int w_f32,
                  int64_t w_rows, void *out, int64_t rows, int64_t d, float eps, int bf16) {
    float v[d];
    for (int64_t r = 0; r < rows; r++) {
        int64_t o = r * d;
        float part[LANES] = {0};
        for (int64_t i = 0; i < d; i++) {
            float a = load_f(x, o + i, bf16);
            if (res) a = store_f(res_out, o + i, a + load_f(res, o + i, bf16), bf16);
            v[i] = a;
            part[i % LANES] += a * a;
        }
        float ss = 0.0f;
        for (int j = 0; j < LANES; j++) ss += part[j];
        float rstd = 1.0f / sqrtf(ss / (float)d + eps);
        int64_t wo = (r % w_rows) * d;
        for (int64_t i = 0; i < d; i++)
            store_f(out, o + i, v[i] * rstd * load_f(w, wo + i, bf16 && !w_f32), bf16);
    }
}
