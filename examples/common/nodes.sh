# Sourced by the examples' launch scripts: takes the multi-node options out of the arguments.
#
#   --nnodes N --node-rank K --master-addr HOST --master-port PORT   (anywhere among the arguments)
#   --max-restarts M   torchrun's elastic restarts (deepspeed_launch.sh with LAUNCHER=torchrun only)
#
# Run the same command on every node, each with its own --node-rank (0 on the node at --master-addr);
# every node starts the same number of ranks (NUM_RANKS with --cpu, else every GPU of the node).
# Sets: nnodes (default 1), node_rank (0), master_addr (127.0.0.1), master_port (MASTER_PORT or 29500),
# max_restarts (0), and args: the remaining arguments, for the script. docs/multinode.md shows each launcher.
nnodes=1
node_rank=0
master_addr=127.0.0.1
master_port="${MASTER_PORT:-29500}"
max_restarts=0
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nnodes|--node-rank|--master-addr|--master-port|--max-restarts)
      if [[ $# -lt 2 ]]; then echo "$1 needs a value" >&2; exit 2; fi
      case "$1" in
        --nnodes) nnodes="$2" ;;
        --node-rank) node_rank="$2" ;;
        --master-addr) master_addr="$2" ;;
        --master-port) master_port="$2" ;;
        --max-restarts) max_restarts="$2" ;;
      esac
      shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
if ! [[ "$nnodes" =~ ^[1-9][0-9]*$ && "$node_rank" =~ ^[0-9]+$ && "$node_rank" -lt "$nnodes" ]]; then
  echo "--nnodes $nnodes --node-rank $node_rank: need 0 <= node-rank < nnodes (one launch per node)" >&2
  exit 2
fi
if ! [[ "$max_restarts" =~ ^[0-9]+$ ]]; then
  echo "--max-restarts $max_restarts: need a number of restarts >= 0" >&2
  exit 2
fi
