#!/bin/bash -l
#PBS -A MyProject
#PBS -q debug-scaling
#PBS -l select=8:system=polaris
#PBS -l place=scatter
#PBS -l walltime=00:45:00
#PBS -l filesystems=home:grand
#PBS -N resnet50
#PBS -k doe
#PBS -o /home/me/run/logs/train.output
#PBS -e /home/me/run/logs/train.err
#PBS -W depend=afterok:1234.polaris-pbs-01
#PBS -l mig_config=/x.json

# PBS Pro job for polaris, written by hvdrun qsub. hvdrun reads the hosts from $PBS_NODEFILE.
set -o pipefail
cd /home/me/run
module use /soft/modulefiles
module load conda
conda activate
export LD_LIBRARY_PATH=/soft/libraries/aws-ofi-nccl/v1.9.1-aws/lib:/soft/libraries/hwloc/lib:$LD_LIBRARY_PATH
module load cudatoolkit
conda activate /home/me/env
export NCCL_DEBUG=INFO
export NOTE='a b;c'
ulimit -c 0
if ! python -c 'import hvdrun' 2>/dev/null; then
  echo "hvdrun: error: the job's Python" python "cannot import hvdrun on $(hostname): install hvdrun into that environment, or give hvdrun qsub --venv, --conda or --python" >&2
  echo 2 > /home/me/run/logs/train.exitcode
  exit 2
fi
echo "hvdrun: job resnet50 started on $(hostname) at $(date -u +%FT%TZ)"
python -m hvdrun --cluster polaris --ranks-per-node 4 --verbose -- train.py --epochs 3 --name 'it'"'"'s $HOME' && rc=0 || rc=$?
echo "$rc" > /home/me/run/logs/train.exitcode
echo "hvdrun: job resnet50 ended with exit code $rc at $(date -u +%FT%TZ)"
exit "$rc"
