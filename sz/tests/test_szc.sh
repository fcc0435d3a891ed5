#!/usr/bin/env bash
# test_szc.sh SZC WORKDIR [SZ_BENCH] - ctest of the szc command line: --help, usage errors, empty
# input, trailing bytes, and a round trip; and of sz_bench --help. Prints one line per failed
# check; exit 1 if any failed.
set -u
SZC="$1"; W="$2"; BENCH="${3:-}"
mkdir -p "$W"
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# expect CODE PATTERN cmd... : exit status CODE and PATTERN (grep -E) in stdout+stderr
expect() {
  local code="$1" pat="$2"; shift 2
  local out rc
  out="$("$@" 2>&1)"; rc=$?
  [ "$rc" = "$code" ] || fail "'$*' exited $rc, want $code; output: $out"
  [ -z "$pat" ] || grep -Eq -- "$pat" <<<"$out" || fail "'$*' output lacks /$pat/: $out"
}

expect 0 "^usage: szc compress" "$SZC" --help
expect 0 "^usage: szc compress" "$SZC" -h
expect 0 "^usage: szc compress" "$SZC" help
expect 0 "^usage: szc compress" "$SZC" info --help
[ -z "$("$SZC" --help 2>&1 >/dev/null)" ] || fail "szc --help wrote to stderr"
if [ -n "$BENCH" ]; then
  expect 0 "^usage: sz_bench" "$BENCH" --help
  expect 2 "^usage: sz_bench" "$BENCH" --no-such-flag
fi
expect 2 "^usage:" "$SZC"
expect 2 "^usage:" "$SZC" info
expect 2 "^usage:" "$SZC" frobnicate -i x
expect 2 "^usage:" "$SZC" info -i x --no-such-flag

: > "$W/empty.sz"
expect 1 "empty input" "$SZC" info -i "$W/empty.sz"
expect 1 "empty input" "$SZC" decompress -i "$W/empty.sz" -o "$W/out.f32"
expect 1 "empty input" "$SZC" compress -i "$W/empty.sz" -o "$W/x.sz" -d 10 -e 1e-3
expect 0 "elements 0" "$SZC" compress -i "$W/empty.sz" -o "$W/zero.sz" -d 0 -e 1e-3

# 1000 floats (the bytes of a repeated pattern are finite floats), round trip, then padding
head -c 4000 /dev/zero | tr '\0' '\101' > "$W/x.f32"
expect 0 "bound held" "$SZC" compress -i "$W/x.f32" -o "$W/x.sz" -d 10,100 -e 1e-3
expect 0 "elements: 1000" "$SZC" info -i "$W/x.sz"
expect 0 "elements 1000" "$SZC" decompress -i "$W/x.sz" -o "$W/y.f32"
{ cat "$W/x.sz"; printf 'X'; } > "$W/pad.sz"
expect 1 "trailing bytes" "$SZC" info -i "$W/pad.sz"
expect 1 "trailing bytes" "$SZC" decompress -i "$W/pad.sz" -o "$W/y.f32"
head -c 50 "$W/x.sz" > "$W/short.sz"
expect 1 "truncated" "$SZC" info -i "$W/short.sz"

if [ "$fails" = 0 ]; then echo "test_szc: all checks passed"; exit 0; fi
echo "test_szc: $fails check(s) failed"; exit 1
