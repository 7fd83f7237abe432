# Sourced by the benchmark scripts: builds the benches in release (the load generator among them) and
# sets LOADGEN to the newest load generator binary.
cargo build --release --benches -q 2>/dev/null || cargo build --release --benches
LOADGEN=$(ls -t target/release/deps/loadgen-* | grep -v '\.d$' | head -1)
