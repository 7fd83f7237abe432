# Sourced by the benchmark scripts: measures the disk itself in the scratch dir $WORK and sets
# DISK_LINE ("disk: N 4 KiB dsync writes/s, M MB/s with 1 MiB dsync writes; DATE UTC"): writes/s of 4 KiB
# with O_DSYNC (what a durable small request costs at best) and MB/s with 1 MiB O_DSYNC writes (what a
# large batch costs), computed from dd's byte count and elapsed seconds (its own rate is rounded and
# in changing units). DD_1M_COUNT (200) sets the 1 MiB writes.
dd_bytes_seconds() {
  LC_ALL=C dd if=/dev/zero of="$WORK/dd" "$@" 2>&1 >/dev/null | tail -1 |
    sed -nE 's/^([0-9]+) bytes.* copied, ([0-9.e+-]+) s,.*/\1 \2/p'
  rm -f "$WORK/dd"
}
read -r _ DD_4K_S < <(dd_bytes_seconds bs=4k count=2000 oflag=dsync) || true
read -r DD_1M_BYTES DD_1M_S < <(dd_bytes_seconds bs=1M count="${DD_1M_COUNT:-200}" oflag=dsync) || true
DISK_LINE="disk: $(awk -v s4="${DD_4K_S:-0}" -v b="${DD_1M_BYTES:-0}" -v s1="${DD_1M_S:-0}" 'BEGIN {
  printf (s4 > 0 ? "%d" : "?"), (s4 > 0 ? 2000 / s4 : 0); printf " 4 KiB dsync writes/s, "
  printf (s1 > 0 ? "%d" : "?"), (s1 > 0 ? b / s1 / 1e6 : 0); printf " MB/s with 1 MiB dsync writes" }'); $(date -u '+%Y-%m-%d %H:%M UTC')"
