#!/bin/sh
# Dependencies point one way (docs/design.md, "Layers"):
#   core <- layouts <- backends <- api <- ref <- tools / bindings / tests
# 1. Every #include "..." in src/ names a directory its layer may use
#    (a bare name is the file's own directory).
# 2. tools/*.c: a file calls kb_* functions defined only in files before it
#    in TOOL_ORDER (probe and cases at the bottom, the CLI's main on top).
# 3. python/kvattn: a module imports (at any depth) only modules before it
#    in PY_ORDER, or the package itself (kvattn/__init__.py, the top).
# Prints each upward dependency and exits 1 when there is one.
cd "$(dirname "$0")/.." || exit 2
bad=0

allowed() { # directory -> the include prefixes it may use
  case "$1" in
  src/core) echo "core" ;;
  src/paged) echo "core paged" ;;
  src/cpu | src/cpu/simd) echo "core paged cpu" ;;
  src/cuda) echo "core paged cuda" ;;
  src/api) echo "core paged cpu cuda api" ;;
  src/ref) echo "core paged api ref" ;;
  *) echo "?" ;;
  esac
}

for f in src/*/*.c src/*/*.h src/*/*.cu src/*/*.cuh src/cpu/simd/*.c src/cpu/simd/*.h; do
  [ -f "$f" ] || continue
  dir=${f%/*}
  ok=$(allowed "$dir")
  for inc in $(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$f"); do
    case "$inc" in
    kvattn.h) continue ;;
    */*) top=${inc%%/*} ;;
    *) continue ;; # same directory
    esac
    case " $ok " in
    *" $top "*) ;;
    *) echo "check_layers: $f includes \"$inc\" ($dir may include: $ok)"; bad=1 ;;
    esac
  done
done

# tools/: no src/ header (the public API only), and calls in TOOL_ORDER.
TOOL_ORDER="probe cases data check backend bench kvattn"
for f in tools/*.c tools/*.h tools/*.cu; do
  [ -f "$f" ] || continue
  if grep -q '^[[:space:]]*#[[:space:]]*include[[:space:]]*"\(core\|api\|paged\|cpu\|cuda\|ref\)/' "$f"; then
    echo "check_layers: $f includes a library-internal header"; bad=1
  fi
done
defs() { grep -o '^[a-z][a-z0-9_ *]*[ *]kb_[a-z0-9_]*(' "tools/$1.c" | grep -o 'kb_[a-z0-9_]*'; }
for f in tools/*.c; do
  n=${f#tools/}; n=${n%.c}
  case " $TOOL_ORDER " in *" $n "*) ;; *) echo "check_layers: $f is not in TOOL_ORDER"; bad=1 ;; esac
done
below=""
for n in $TOOL_ORDER; do
  above=0
  for m in $TOOL_ORDER; do
    [ "$m" = "$n" ] && { above=1; continue; }
    [ $above = 1 ] || continue
    for fn in $(defs "$m"); do
      if defs "$n" | grep -qx "$fn"; then continue; fi
      if grep -q "\b$fn(" "tools/$n.c"; then
        echo "check_layers: tools/$n.c calls $fn, defined above it in tools/$m.c"; bad=1
      fi
    done
  done
  below="$below $n"
done

# python/kvattn: imports in PY_ORDER (the package __init__ is the top).
PY_ORDER="_capi cuda paged compose torch_ops"
for n in $PY_ORDER; do
  f=python/kvattn/$n.py
  [ -f "$f" ] || continue
  above=0
  for m in $PY_ORDER; do
    [ "$m" = "$n" ] && { above=1; continue; }
    [ $above = 1 ] || continue
    if grep -Eq "^[[:space:]]*(from \.$m import|from \. import .*\b$m\b|import kvattn\.$m|from kvattn\.$m import)" "$f"; then
      echo "check_layers: $f imports $m, which is above it"; bad=1
    fi
  done
done

[ $bad = 0 ] && echo "check_layers: ok"
exit $bad
