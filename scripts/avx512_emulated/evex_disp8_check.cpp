// EVEX-encoded loads with an 8-bit displacement, each against the value it must load. EVEX scales
// such a displacement by N, the tuple's memory operand size (Intel SDM vol. 2, 2.7.5: N = 1 for
// VPINSRB, 2 for VPINSRW, 4 / 8 for VPINSRD / VPINSRQ, 32 for a full ymm load).
//
// Bochs 2.7 (Debian bookworm) gets VPINSRB wrong: it scales the displacement by 2 and loads the
// wrong byte. The other forms here are right. check.sh runs this to show it, which is why it also
// runs a build of the kernels kept out of xmm16-31 (there the assembler picks the VEX form of
// VPINSRB, which Bochs emulates correctly).
#include <cstdio>
#include <cstdint>
#include <cstring>
static int bad = 0;
static void check(const char* name, const uint8_t* got, const uint8_t* want, int n) {
  bool ok = memcmp(got, want, n) == 0;
  printf("%-48s %s\n", name, ok ? "ok" : "WRONG");
  if (!ok) { bad++; printf("   got "); for (int i = 0; i < n; ++i) printf("%02x", got[i]); printf("\n  want "); for (int i = 0; i < n; ++i) printf("%02x", want[i]); printf("\n"); }
}
int main() {
  alignas(64) uint8_t a[32], out[32], want[32], mem[256];
  for (int i = 0; i < 32; ++i) a[i] = uint8_t(17 * i + 3);
  for (int i = 0; i < 256; ++i) mem[i] = uint8_t(i * 29 + 11);
  uint8_t* base = mem + 128;
  // vpinsrb: index = pos
  memset(out, 0, 32); memcpy(want, a, 16); want[1] = base[-8];
  asm volatile("vmovdqu8 (%1), %%xmm25\n\tvpinsrb $1, -8(%2), %%xmm25, %%xmm25\n\tvmovdqu8 %%xmm25, (%0)" :: "r"(out), "r"(a), "r"(base) : "xmm25", "memory");
  check("vpinsrb $1, -8(base), %xmm25", out, want, 16);
  memset(out, 0, 32); memcpy(want, a, 16); want[1] = base[-20];
  asm volatile("vmovdqu8 (%1), %%xmm21\n\tvpinsrb $1, -20(%2), %%xmm21, %%xmm21\n\tvmovdqu8 %%xmm21, (%0)" :: "r"(out), "r"(a), "r"(base) : "xmm21", "memory");
  check("vpinsrb $1, -20(base), %xmm21", out, want, 16);
  memset(out, 0, 32); memcpy(want, a, 16); want[1] = base[-4];
  asm volatile("vmovdqu (%1), %%xmm0\n\t%{evex%} vpinsrb $1, -4(%2), %%xmm0, %%xmm0\n\tvmovdqu %%xmm0, (%0)" :: "r"(out), "r"(a), "r"(base) : "xmm0", "memory");
  check("{evex} vpinsrb $1, -4(base), %xmm0", out, want, 16);
  memset(out, 0, 32); memcpy(want, a, 16); memcpy(want + 6, base - 6, 2);
  asm volatile("vmovdqu8 (%1), %%xmm20\n\tvpinsrw $3, -6(%2), %%xmm20, %%xmm20\n\tvmovdqu8 %%xmm20, (%0)" :: "r"(out), "r"(a), "r"(base) : "xmm20", "memory");
  check("vpinsrw $3, -6(base), %xmm20", out, want, 16);
  memset(out, 0, 32); memcpy(want, a, 16); memcpy(want + 8, base + 16, 8);
  asm volatile("vmovdqu8 (%1), %%xmm22\n\tvpinsrq $1, 16(%2), %%xmm22, %%xmm22\n\tvmovdqu8 %%xmm22, (%0)" :: "r"(out), "r"(a), "r"(base) : "xmm22", "memory");
  check("vpinsrq $1, 16(base), %xmm22", out, want, 16);
  memset(out, 0, 32); memcpy(want, a, 16); memcpy(want + 4, base - 12, 4);
  asm volatile("vmovdqu8 (%1), %%xmm22\n\tvpinsrd $1, -12(%2), %%xmm22, %%xmm22\n\tvmovdqu8 %%xmm22, (%0)" :: "r"(out), "r"(a), "r"(base) : "xmm22", "memory");
  check("vpinsrd $1, -12(base), %xmm22", out, want, 16);
  // vmovdqu8 / vmovdqa64 loads with disp (N = 32)
  memcpy(want, base + 64, 32);
  asm volatile("vmovdqu8 64(%1), %%ymm23\n\tvmovdqu8 %%ymm23, (%0)" :: "r"(out), "r"(base) : "xmm23", "memory");
  check("vmovdqu8 64(base), %ymm23", out, want, 32);
  memcpy(want, base - 96, 32);
  asm volatile("vmovdqu8 -96(%1), %%ymm23\n\tvmovdqu8 %%ymm23, (%0)" :: "r"(out), "r"(base) : "xmm23", "memory");
  check("vmovdqu8 -96(base), %ymm23", out, want, 32);
  // vmovq / vmovd with high regs and disp
  memset(out, 0, 32); memset(want, 0, 32); memcpy(want, base - 24, 8);
  asm volatile("vmovq -24(%1), %%xmm24\n\tvmovdqu8 %%ymm24, (%0)" :: "r"(out), "r"(base) : "xmm24", "memory");
  check("vmovq -24(base), %xmm24", out, want, 32);
  memset(out, 0, 32); memset(want, 0, 32); memcpy(want, base - 28, 4);
  asm volatile("vmovd -28(%1), %%xmm24\n\tvmovdqu8 %%ymm24, (%0)" :: "r"(out), "r"(base) : "xmm24", "memory");
  check("vmovd -28(base), %xmm24", out, want, 32);
  // vpbroadcastq / vpbroadcastd / vpbroadcastw / vpbroadcastb from memory with disp into high regs
  for (int i = 0; i < 4; ++i) memcpy(want + 8 * i, base - 40, 8);
  asm volatile("vpbroadcastq -40(%1), %%ymm25\n\tvmovdqu8 %%ymm25, (%0)" :: "r"(out), "r"(base) : "xmm25", "memory");
  check("vpbroadcastq -40(base), %ymm25", out, want, 32);
  for (int i = 0; i < 8; ++i) memcpy(want + 4 * i, base + 12, 4);
  asm volatile("vpbroadcastd 12(%1), %%ymm25\n\tvmovdqu8 %%ymm25, (%0)" :: "r"(out), "r"(base) : "xmm25", "memory");
  check("vpbroadcastd 12(base), %ymm25", out, want, 32);
  for (int i = 0; i < 16; ++i) memcpy(want + 2 * i, base - 6, 2);
  asm volatile("vpbroadcastw -6(%1), %%ymm25\n\tvmovdqu8 %%ymm25, (%0)" :: "r"(out), "r"(base) : "xmm25", "memory");
  check("vpbroadcastw -6(base), %ymm25", out, want, 32);
  for (int i = 0; i < 32; ++i) want[i] = base[-3];
  asm volatile("vpbroadcastb -3(%1), %%ymm25\n\tvmovdqu8 %%ymm25, (%0)" :: "r"(out), "r"(base) : "xmm25", "memory");
  check("vpbroadcastb -3(base), %ymm25", out, want, 32);
  // vcvtph2ps from memory (EVEX, high reg): 4 halves at base-8 -> 4 floats; and vpinsrw+vcvtph2ps
  {
    uint16_t h[4] = {0x3c00, 0xc000, 0x3555, 0x0400}; memcpy(base - 8, h, 8);
    float f[4] = {1.0f, -2.0f, 0.333251953125f, 6.103515625e-05f}; memset(want, 0, 32); memcpy(want, f, 16);
    memset(out, 0, 32);
    asm volatile("vcvtph2ps -8(%1), %%xmm26\n\tvmovdqu8 %%xmm26, (%0)" :: "r"(out), "r"(base) : "xmm26", "memory");
    check("vcvtph2ps -8(base), %xmm26", out, want, 16);
  }
  printf("bad=%d\n", bad);
  return bad ? 1 : 0;
}
