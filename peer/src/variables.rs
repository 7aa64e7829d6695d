//! Every `ECCL_*` environment variable that eccl, its tools and its test command read, in
//! one list. `docs/configuration.md` is checked against it, and so is the source tree (no
//! variable is read anywhere that is not here): `python/tests/test_docs.py`.
//!
//! A flag or an API argument beats the variable; the variable beats the default.

/// One environment variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variable {
    pub name: &'static str,
    /// Its default, as a user would write it ("—": none).
    pub default: &'static str,
    /// Who reads it: `peer` (the library, in Rust and Python), `master`, `torch` (the
    /// torch backend and torchrun handler), `tools` (eccl-bench, eccl-chaos), `tests`
    /// (the test command and the test suites).
    pub read_by: &'static str,
    pub meaning: &'static str,
}

const fn v(
    name: &'static str,
    default: &'static str,
    read_by: &'static str,
    meaning: &'static str,
) -> Variable {
    Variable {
        name,
        default,
        read_by,
        meaning,
    }
}

/// The list, peers' first, then the master's, the torch backend's, the tools' and the
/// tests'.
pub const VARIABLES: &[Variable] = &[
    v("ECCL_MASTER", "127.0.0.1:48148", "peer", "the masters' client addresses, comma-separated"),
    v("ECCL_SECRET", "—", "peer, master, torch", "the job secret: a key of 64 hex digits, or a passphrase of 16 bytes or more (stretched)"),
    v("ECCL_SECRET_FILE", "~/.eccl/secret", "peer, master, torch", "a file holding the job secret, readable by its owner only"),
    v("ECCL_DEBUG", "WARN", "peer, master, tools", "log level: WARN, INFO (explains decisions), DEBUG, TRACE"),
    v("ECCL_DEBUG_SUBSYS", "all", "peer, master, tools", "comma list of INIT, COLL, NET, MASTER"),
    v("ECCL_ALGO", "tuned per call", "peer", "force an algorithm: ring, direct, tree"),
    v("ECCL_TOPOLOGY", "off", "peer", "optimize: measure the links and solve the ring order whenever the world changes (set it on every member)"),
    v("ECCL_TRANSPORT", "auto", "peer", "links: auto (shm on one host, TCP across), tcp, shm, quic"),
    v("ECCL_TLS", "0", "peer", "1: TLS 1.3 on TCP links, and refuse plaintext ones"),
    v("ECCL_HOST_ID", "hostname, boot id, network namespace", "peer", "who can share memory with whom"),
    v("ECCL_SHM_SPIN_US", "100, or 2 when local peers outnumber cores", "peer", "how long a shared-memory wait, and a Python Work.wait(), spins before it sleeps"),
    v("ECCL_SHM_POOL_MB", "1024", "torch", "most bytes of dropped `allocate_tensor` memory (host shared memory) a process keeps to hand out again at the same size; `0` keeps none"),
    v("ECCL_SOCKET_IFNAME", "all interfaces", "peer", "interface whose address peers listen on and advertise"),
    v("ECCL_BUFFSIZE", "1M", "peer", "bytes per frame (4 KiB to 64 MiB); a shared-memory slot is this, at least 1 MiB"),
    v("ECCL_NSTREAMS", "auto", "peer", "streams per TCP, TLS or QUIC link, frames dealt across them: N, or auto (one, and more on a TCP link that optimize_topology() found held back by its window)"),
    v("ECCL_REDUCE_THREADS", "the host's cores over the ranks on it, 1–4", "peer", "threads one reduction of 256 KiB or more may use (the same bits with any count); ECCL_DEBUG=INFO logs the choice"),
    v("ECCL_TIMEOUT_MS", "30000", "peer", "a collective with no progress for this long fails with Timeout"),
    v("ECCL_CONNECT_TIMEOUT_MS", "10000", "peer", "how long to try to reach a master before MasterUnavailable"),
    v("ECCL_JOIN_TIMEOUT_MS", "300000", "peer", "how long update_topology() waits for the other members"),
    v("ECCL_RANK_HINT", "—", "peer", "the rank asked for at admission (torchrun's RANK is read too)"),
    v("ECCL_MIN_WORLD", "1", "peer", "the smallest first world (torchrun's WORLD_SIZE is read too)"),
    v("ECCL_FAULT_INJECT", "—", "peer", "POINT:ACTION[@n]: kill or stop this process, or hold it delayMS milliseconds, at a point of the protocol (eccl-chaos --inject sets it)"),
    v("ECCL_KERNEL_CACHE", "$XDG_CACHE_HOME/eccl/kernels, else ~/.cache/eccl/kernels", "peer", "folder of the compiled device kernels, one file per architecture and NVRTC version; off: compile in every process"),
    v("ECCL_NVRTC_LIB", "the loader's path, then pip's nvidia wheels", "peer", "the libnvrtc that compiles the device kernels on first use"),
    v("ECCL_CUDA_IPC", "1", "peer, torch", "0: device collectives on one host go through host memory instead of GPU to GPU over CUDA IPC (every device collective as a pipeline of chunks; any rank setting it decides for the world)"),
    v("ECCL_LEASE_MS", "800", "master, torch", "a peer silent for this long is evicted (eccl-master --lease-ms; the torch backend's embedded master)"),
    v("ECCL_HEARTBEAT_MS", "200", "master, torch", "how often peers renew their lease (eccl-master --heartbeat-ms)"),
    v("ECCL_MASTER_LISTEN", "127.0.0.1:48148", "master", "eccl-master --listen"),
    v("ECCL_MASTER_DATA_DIR", "—", "master", "eccl-master --data-dir: keep the raft log, vote and snapshots here"),
    v("ECCL_CLUSTER_SECRET_FILE", "~/.eccl/cluster-secret", "master", "eccl-master --cluster-secret-file: the secret masters share"),
    v("ECCL_MASTER_BIN", "eccl-master beside eccl-bench", "tools", "the master eccl-bench --local starts"),
    v("ECCL_BENCH_QUIET", "—", "tools", "set by eccl-bench --local for ranks other than 0: print no table"),
    v("ECCL_BENCH_NO_JSON", "—", "tools", "set by eccl-bench --local for ranks other than 0: write no --json file"),
    v("ECCL_CHAOS_CLUSTER_SECRET", "—", "tools", "set by eccl-chaos for the masters it starts"),
    v("ECCL_SKIP_TORCH", "—", "tests", "bash .ci/test.sh without torch (and without the Python tests)"),
    v("ECCL_SOAK", "—", "tests", "bash .ci/test.sh also runs the long chaos runs and the soak"),
    v("ECCL_BENCH", "—", "tests", "bash .ci/test.sh also runs the benchmark tests (the goodput benchmark)"),
    v("ECCL_TORCH_SUITE", "—", "tests", "bash .ci/test.sh also runs torch's whole backend suite under eccl and gloo (about 30 min)"),
    v("ECCL_TORCHFT", "—", "tests", "bash .ci/test.sh also runs torchft on eccl (installs torchft into .venv-torchft)"),
    v("ECCL_CHAOS_SEED", "random", "tests", "the seed of the test command's chaos runs"),
    v("ECCL_FUZZ_CASES", "2000", "tests", "cases per property of the decoders' property tests"),
    v("ECCL_FUZZ_SECONDS", "6", "tests", "seconds of cargo fuzz per target in the test command"),
    v("ECCL_RANK", "—", "tests", "a test script's rank (python/tests/elastic_parity.py)"),
    v("ECCL_WORLD", "—", "tests", "a test script's world size (python/tests/elastic_parity.py)"),
    v("ECCL_REQUIRE_NVRTC", "—", "tests", "set by the test command: the kernel compile test fails, rather than skips, without libnvrtc"),
    v("ECCL_TEST_DEVICE", "cpu", "tests", "cuda: the torch test script's tensors are CUDA tensors (python/tests/test_cuda.py)"),
    v("ECCL_TEST_CPU", "—", "tests", "a file: the Python tests append each test's wall time and the machine's CPU seconds meanwhile (python/tests/conftest.py)"),
];
