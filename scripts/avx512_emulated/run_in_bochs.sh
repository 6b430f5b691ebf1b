#!/usr/bin/env bash
# run_in_bochs.sh BINARY [ARGS...]
#
# Runs a statically linked x86-64 Linux executable inside a minimal Linux guest
# booted in Bochs (cpu model tigerlake => AVX-512 F/BW/VL/VNNI/...), prints the
# binary's stdout+stderr on the host and exits with the binary's exit status.
#
# Environment:
#   BOCHS_TIMEOUT   seconds before giving up (default 1200); exit 124 on timeout
#   BOCHS_CPU       Bochs CPU model (default tigerlake; corei7_icelake_u also has AVX-512)
#   BOCHS_IPS       Bochs "ips" setting (default 100000000); only affects guest time keeping
#   BOCHS_MEGS      guest RAM in MiB (default 512)
#   BOCHS_VERBOSE=1 stream the raw serial console to stderr while running, and print
#                   the guest's avx512 flags and timings to stderr
#   BOCHS_KEEP=1    keep the per-run work directory (bochsrc, serial.out, bochs.log)
#   BOCHS_KCMD      replace the whole kernel command line; BOCHS_KCMD_EXTRA appends to it
#
# Notes on Bochs 2.7 (Debian) quirks worked around here:
#  * Debian's bochs has no "nogui" display library: we use rfb with timeout=0 (never
#    waits for a VNC client; listens on a free port 5900-5949).
#  * It is built with the internal debugger, which stops before the first instruction;
#    we feed it "c" via -rc.
#  * tigerlake's CPUID leaf 0xD is wrong for PKRU and for the compacted (XSAVES) size,
#    which makes Linux disable XSAVE (and with it AVX/AVX-512); and with FSRM advertised
#    Linux 6.1 hangs early in boot (page-fault loop). Hence the kernel gets
#    clearcpuid=pku,xsaves,xsavec,fsrm (affects only the kernel; the guest program's
#    CPUID still shows all features, including avx512vnni).
#
# Exit status: the binary's exit status; 124 on timeout; 125 on harness/boot failure
# (Bochs exited without printing the exit marker).
#
# First run downloads (apt-get download) the kernel, busybox-static, isolinux and
# syslinux-common into $BOCHS_CACHE (default: out/bochs in the repository) and builds the
# fixed parts; later runs reuse them.
# Host tools needed: bochs (+bochsbios, vgabios), xorriso, cpio, gzip, python3, apt-get/dpkg.
set -u

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${BOCHS_CACHE:-$HERE/../../out/bochs}"
TIMEOUT="${BOCHS_TIMEOUT:-1200}"
CPU_MODEL="${BOCHS_CPU:-tigerlake}"
IPS="${BOCHS_IPS:-100000000}"
MEGS="${BOCHS_MEGS:-512}"
VERBOSE="${BOCHS_VERBOSE:-0}"
KCMD="${BOCHS_KCMD:-console=ttyS0,115200 quiet loglevel=1 panic=-1 mitigations=off nokaslr clearcpuid=pku,xsaves,xsavec,fsrm rdinit=/init} ${BOCHS_KCMD_EXTRA:-}"

KPKG_PATTERN='linux-image-6.1.0-*-cloud-amd64'   # cloud flavour: smaller, boots faster

die() { echo "run_in_bochs: $*" >&2; exit 125; }
log() { [ "$VERBOSE" = 1 ] && echo "run_in_bochs: $*" >&2; return 0; }

[ $# -ge 1 ] || die "usage: $0 BINARY [ARGS...]"
BIN="$1"; shift
[ -f "$BIN" ] || die "no such file: $BIN"
for t in bochs xorriso cpio gzip python3 dpkg; do
  command -v "$t" >/dev/null 2>&1 || die "missing host tool: $t (apt-get install bochs bochsbios vgabios xorriso cpio)"
done

# ---------------------------------------------------------------- cache setup
setup_cache() {
  mkdir -p "$CACHE" || die "cannot create $CACHE"
  exec 9>"$CACHE/.lock"; flock 9
  if [ -f "$CACHE/READY" ]; then flock -u 9; return 0; fi
  echo "run_in_bochs: first run: preparing $CACHE ..." >&2
  (
    set -e
    cd "$CACHE"
    mkdir -p debs x
    cd debs
    if ! ls linux-image-*.deb >/dev/null 2>&1; then
      kpkg=$(apt-cache search --names-only "^linux-image-6\.1\.0-[0-9]+-cloud-amd64$" | awk '{print $1}' | sort -V | tail -1)
      [ -n "$kpkg" ] || { echo "no $KPKG_PATTERN package found" >&2; exit 1; }
      apt-get download "$kpkg"
    fi
    ls busybox-static_*.deb >/dev/null 2>&1 || apt-get download busybox-static
    ls isolinux_*.deb >/dev/null 2>&1 || apt-get download isolinux
    ls syslinux-common_*.deb >/dev/null 2>&1 || apt-get download syslinux-common
    cd ..
    for d in debs/*.deb; do dpkg -x "$d" x; done
    cp x/boot/vmlinuz-* vmlinuz
    cp x/usr/lib/ISOLINUX/isolinux.bin isolinux.bin
    cp x/usr/lib/syslinux/modules/bios/ldlinux.c32 ldlinux.c32

    # base initramfs: busybox + /init
    rm -rf rootfs; mkdir -p rootfs/bin rootfs/sbin rootfs/proc rootfs/sys rootfs/dev rootfs/tmp rootfs/work
    cp x/bin/busybox rootfs/bin/busybox
    for a in $(rootfs/bin/busybox --list); do
      [ -e "rootfs/bin/$a" ] || ln -s busybox "rootfs/bin/$a"
    done
    cat > rootfs/init <<'EOF'
#!/bin/sh
export PATH=/bin:/sbin HOME=/work
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mount -t tmpfs tmp /tmp
# raw output: no \n -> \r\n translation on the serial console
stty -F /dev/console -opost 2>/dev/null
exec </dev/null >/dev/console 2>&1
echo "@@AVX512 $(grep -o -E 'avx512[a-z0-9_]*' /proc/cpuinfo | sort -u | tr '\n' ' ')@@"
echo "@@UPTIME $(cut -d' ' -f1 /proc/uptime)@@"
cd /work
echo "@@START@@"
/bin/sh /run.sh
rc=$?
printf '\n@@EXIT %d@@\n' "$rc"
echo "@@UPTIME $(cut -d' ' -f1 /proc/uptime)@@"
sync
# let the serial console drain before the power goes (the host stops reading at the marker)
sleep 3
poweroff -f
EOF
    chmod 755 rootfs/init
    (cd rootfs && find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) > base.cpio
    touch READY
  ) || { flock -u 9; die "cache setup failed"; }
  flock -u 9
}
setup_cache

# ---------------------------------------------------------------- per-run dir
mkdir -p "$CACHE/runs"
WORK="$(mktemp -d "$CACHE/runs/run.XXXXXX")" || die "mktemp failed"
BOCHS_PID=""
cleanup() {
  if [ -n "$BOCHS_PID" ] && kill -0 "$BOCHS_PID" 2>/dev/null; then
    kill -TERM "$BOCHS_PID" 2>/dev/null; sleep 0.3
    kill -KILL "$BOCHS_PID" 2>/dev/null
    wait "$BOCHS_PID" 2>/dev/null
  fi
  [ -n "${TAIL_PID:-}" ] && kill "$TAIL_PID" 2>/dev/null
  if [ "${BOCHS_KEEP:-0}" = 1 ]; then echo "run_in_bochs: kept $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# per-run initramfs overlay: the binary and a run.sh with the quoted args
mkdir -p "$WORK/ov/work" "$WORK/iso/isolinux"
cp "$BIN" "$WORK/ov/work/prog" && chmod 755 "$WORK/ov/work/prog"
sq() { printf "'%s'" "$(printf '%s' "$1" | sed "s/'/'\\\\''/g")"; }
{
  printf '#!/bin/sh\nexec /work/prog'
  for a in "$@"; do printf ' %s' "$(sq "$a")"; done
  printf '\n'
} > "$WORK/ov/run.sh"
# argv[0] should look like the host name of the binary
(cd "$WORK/ov" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) > "$WORK/ov.cpio" || die "cpio failed"
cat "$CACHE/base.cpio" "$WORK/ov.cpio" | gzip -1 > "$WORK/iso/initrd.gz"
cp "$CACHE/vmlinuz" "$WORK/iso/vmlinuz"
cp "$CACHE/isolinux.bin" "$CACHE/ldlinux.c32" "$WORK/iso/isolinux/"
printf 'DEFAULT linux\nPROMPT 0\nTIMEOUT 0\nLABEL linux\n  KERNEL /vmlinuz\n  APPEND initrd=/initrd.gz %s\n' "$KCMD" > "$WORK/iso/isolinux/isolinux.cfg"
xorriso -as mkisofs -quiet -o "$WORK/boot.iso" -b isolinux/isolinux.bin -c isolinux/boot.cat \
  -no-emul-boot -boot-load-size 4 -boot-info-table "$WORK/iso" >/dev/null 2>&1 || die "xorriso failed"
rm -rf "$WORK/iso" "$WORK/ov" "$WORK/ov.cpio"

cat > "$WORK/bochsrc" <<EOF
config_interface: textconfig
display_library: rfb, options="timeout=0"
memory: guest=$MEGS, host=$MEGS
cpu: model=$CPU_MODEL, count=1, ips=$IPS, reset_on_triple_fault=0
romimage: file=/usr/share/bochs/BIOS-bochs-latest
vgaromimage: file=/usr/share/vgabios/vgabios.bin
ata0: enabled=1, ioaddr1=0x1f0, ioaddr2=0x3f0, irq=14
ata0-master: type=cdrom, path="$WORK/boot.iso", status=inserted
ata1: enabled=0
boot: cdrom
floppy_bootsig_check: disabled=1
clock: sync=none, time0=local
com1: enabled=1, mode=file, dev="$WORK/serial.out"
mouse: enabled=0
speaker: enabled=0
sound: waveoutdrv=dummy, waveindrv=dummy, midioutdrv=dummy
pci: enabled=1, chipset=i440fx
log: $WORK/bochs.log
panic: action=fatal
error: action=report
info: action=report
debug: action=ignore
EOF

: > "$WORK/serial.out"
# Debian's bochs is built with the internal debugger, which stops at the first
# instruction: tell it to continue. At the end the debugger reads EOF and quits.
printf 'c\nquit\n' > "$WORK/dbgcmds"
T0=$(date +%s.%N)
( cd "$WORK" && exec bochs -q -f "$WORK/bochsrc" -rc "$WORK/dbgcmds" </dev/null >"$WORK/bochs.stdout" 2>&1 ) &
BOCHS_PID=$!
if [ "$VERBOSE" = 1 ]; then tail -n +1 -f "$WORK/serial.out" >&2 & TAIL_PID=$!; fi

status=""
deadline=$(( $(date +%s) + TIMEOUT ))
while :; do
  if grep -aq '@@EXIT [0-9]*@@' "$WORK/serial.out" 2>/dev/null; then status=done; break; fi
  if ! kill -0 "$BOCHS_PID" 2>/dev/null; then
    sleep 0.2
    grep -aq '@@EXIT [0-9]*@@' "$WORK/serial.out" && status=done || status=died
    break
  fi
  if [ "$(date +%s)" -ge "$deadline" ]; then status=timeout; break; fi
  sleep 0.25
done
T1=$(date +%s.%N)
# give the guest a moment to flush the trailing uptime line, then stop Bochs
if [ "$status" = done ]; then sleep 0.3; fi
if kill -0 "$BOCHS_PID" 2>/dev/null; then kill -TERM "$BOCHS_PID" 2>/dev/null; sleep 0.3; kill -KILL "$BOCHS_PID" 2>/dev/null; fi
wait "$BOCHS_PID" 2>/dev/null; BOCHS_PID=""
[ -n "${TAIL_PID:-}" ] && { kill "$TAIL_PID" 2>/dev/null; wait "$TAIL_PID" 2>/dev/null; TAIL_PID=""; }

if [ "$status" != done ]; then
  echo "run_in_bochs: guest did not finish ($status) after $(python3 -c "print('%.1f' % ($T1-$T0))")s; last serial output:" >&2
  tail -c 3000 "$WORK/serial.out" >&2; echo >&2
  echo "run_in_bochs: last bochs log lines:" >&2
  tail -n 15 "$WORK/bochs.log" >&2 2>/dev/null
  [ "$status" = timeout ] && exit 124
  exit 125
fi

python3 - "$WORK/serial.out" "$VERBOSE" "$T0" "$T1" <<'EOF'
import re, sys
data = open(sys.argv[1], 'rb').read()
verbose = sys.argv[2] == '1'
start = data.find(b'@@START@@\n')
m = None
for m in re.finditer(rb'\n@@EXIT (\d+)@@', data): pass
if start < 0 or m is None:
    sys.stderr.write('run_in_bochs: markers not found\n'); sys.exit(125)
out = data[start + len(b'@@START@@\n'):m.start()]
sys.stdout.buffer.write(out); sys.stdout.flush()
rc = int(m.group(1))
if verbose:
    av = re.search(rb'@@AVX512 ([^@]*)@@', data)
    ups = re.findall(rb'@@UPTIME ([0-9.]+)@@', data)
    sys.stderr.write('run_in_bochs: guest avx512 flags: %s\n' % (av.group(1).decode().strip() if av else '?'))
    sys.stderr.write('run_in_bochs: guest uptime at start/end: %s; host wall %.1fs; rc=%d\n'
                     % ([u.decode() for u in ups], float(sys.argv[4]) - float(sys.argv[3]), rc))
open(sys.argv[1] + '.rc', 'w').write(str(rc))
EOF
prc=$?
[ $prc -ne 0 ] && exit 125
exit "$(cat "$WORK/serial.out.rc")"
