#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (Debian/Ubuntu, as root, no systemd, no cgroups) for
# exercising the Slurm executor's preemption path for real (benchmarks/slurm/preempt_requeue.py).
# Idempotent: installs, (re)writes the config, restarts munged/slurmctld/slurmd, waits until idle.
#
#     sudo bash benchmarks/slurm/setup_local_slurm.sh     # then: sinfo; srun -n 2 hostname
set -euo pipefail

LAB=${SLURM_LAB:-/tmp/slurm_lab}   # state, spool and daemon logs
NODE=$(hostname -s)
CPUS=$(nproc)

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurmctld slurmd slurm-client munge
fi

# munge authenticates every Slurm RPC; the package creates a key, make one if it did not.
[ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024; }
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged

mkdir -p "$LAB"/{state,spool,log} /etc/slurm
cat > /etc/slurm/slurm.conf <<EOF
ClusterName=lab
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$LAB/state
SlurmdSpoolDir=$LAB/spool
SlurmctldLogFile=$LAB/log/slurmctld.log
SlurmdLogFile=$LAB/log/slurmd.log
SlurmctldPidFile=$LAB/slurmctld.pid
SlurmdPidFile=$LAB/slurmd.pid
# No cgroups in a container: track processes by parent pid, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
# The preemption path under test: jobs may be requeued (scontrol requeue, --requeue).
JobRequeue=1
# A requeued job may not start before cred_expire seconds have passed (default 120); shorten the wait.
AuthInfo=cred_expire=10
# Keep finished jobs visible to 'scontrol show job' (there is no accounting database for sacct).
MinJobAge=3600
# Fake GPUs, one per CPU (null-device nodes, below): the project's sbatch script asks for
# --gpus-per-node and its task count follows it. CPU torch ignores them.
GresTypes=gpu
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS Gres=gpu:$CPUS State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
# Slurm counts GPUs only from device files (a bare Count= registers 0 and the node goes INVAL).
mkdir -p "$LAB/dev"
for i in $(seq 0 $((CPUS - 1))); do [ -e "$LAB/dev/gpu$i" ] || mknod "$LAB/dev/gpu$i" c 1 3; done
printf 'AutoDetect=off\nNodeName=%s Name=gpu File=%s/dev/gpu[0-%d]\n' "$NODE" "$LAB" $((CPUS - 1)) > /etc/slurm/gres.conf

# Restart the daemons with this config (pid files are ours; nothing else is touched).
for pidfile in "$LAB/slurmctld.pid" "$LAB/slurmd.pid"; do
  [ -s "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null && sleep 1 || true
done
/usr/sbin/slurmctld -i   # -i: start even if the saved state of an earlier lab is unreadable
/usr/sbin/slurmd
for _ in $(seq 30); do
  sinfo -h -o %T 2>/dev/null | grep -qx idle && break
  scontrol update nodename="$NODE" state=resume 2>/dev/null || true
  sleep 1
done
sinfo
