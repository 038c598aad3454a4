"""The wire protocol's version, default address and limits: what protocol v1 accepts.

Every bound a message field is checked against lives here, so the service, the client and the
tools that probe the service (benchmarks/service_*fuzz.py) read the same numbers.
"""

# One rank's GPU over a whole iteration draws at most what it may over one instruction.
from perseus.profiler.profile import MAX_POWER_W as MAX_POWER_W

PROTOCOL_VERSION = 1
# The table's format within v1 (named for the profiling sweep, its first change): 4 = as 3, and
# the rank reads `Table.reference`; 3 = as 2, and the rank sweeps again when the service asks a
# later `Table.sweep_round` than the one it uploaded in; 2 = the service designs the sweep and
# sends every step (`Table.sweep_steps`; a rank asks with `GetTable.sweep_version`); 1 = ranks
# computed it.
SWEEP_VERSION = 4
MIN_SWEEP_VERSION = 2  # the oldest a service sends sweep steps to (in round 0 only: see ROUNDS_SWEEP_VERSION)
ROUNDS_SWEEP_VERSION = 3  # the oldest a service asks for a later sweep round
REFERENCE_SWEEP_VERSION = 4  # the oldest a service tells reference windows (older ranks see a plan)
DEFAULT_ADDRESS = "tcp://127.0.0.1:7787"
#: The planner service's address for ranks and for the commands that talk to it, when not given.
PLANNER_ENV = "PERSEUS_PLANNER"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # larger: a too_large error reply
HARD_MESSAGE_BYTES = 4 * MAX_MESSAGE_BYTES  # zmq.MAXMSGSIZE: zmq drops a peer that sends more
MAX_ID = 2**63 - 1
MAX_ITERATION = 2**62  # what the service sends (a plan starts a bounded lead after a rank's iteration)
MAX_RANK_ITERATION = 2**53  # what a rank may report: far past any real run, far below MAX_ITERATION
# An iteration or instruction lasts at least a microsecond and at most a day; one rank's GPU
# spends at most 10 MJ in one (10 kW for 1,000 s). Values outside are bugs or attacks, and
# derived values (1 / time, sums over ranks) stay finite within them.
MIN_TIME_S = 1e-6
MAX_TIME_S = 86_400.0
MAX_ENERGY_J = 1e7
MAX_RANKS = 1 << 20
MAX_FREQUENCY_MHZ = 100_000
MAX_FREQUENCIES = 1024
MAX_SWEEP_STEPS = 1 << 14
# Per job. The service decodes, hashes and saves a job's stage orders on its loop thread (the
# schedule is built on a worker): 32,768 instructions keep that near 0.1 s (benchmarks/service_register.py).
MAX_INSTRUCTIONS = 1 << 15
MAX_PROFILE_ROWS = 100_000
MAX_STRAGGLER_FACTOR = 10.0
