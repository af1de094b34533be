#!/bin/bash -l
#PBS -A MyProject
#PBS -q by-node
#PBS -l select=2
#PBS -l place=scatter
#PBS -l walltime=01:00:00
#PBS -l filesystems=home:eagle
#PBS -N train
#PBS -k doe
#PBS -o /home/me/run/logs/train.output
#PBS -j oe

# PBS Pro job for sophia, written by hvdrun qsub. hvdrun reads the hosts from $PBS_NODEFILE.
set -o pipefail
cd /home/me/run
module use /soft/modulefiles
module load compilers/openmpi
module load conda
conda activate base
if ! /home/me/venv/bin/python -c 'import hvdrun' 2>/dev/null; then
  echo "hvdrun: error: the job's Python" /home/me/venv/bin/python "cannot import hvdrun on $(hostname): install hvdrun into that environment, or give hvdrun qsub --venv, --conda or --python" >&2
  echo 2 > /home/me/run/logs/train.exitcode
  exit 2
fi
echo "hvdrun: job train started on $(hostname) at $(date -u +%FT%TZ)"
/home/me/venv/bin/python -m hvdrun --cluster sophia --ranks-per-node 8 -- train.py --epochs 3 --name 'it'"'"'s $HOME' && rc=0 || rc=$?
echo "$rc" > /home/me/run/logs/train.exitcode
echo "hvdrun: job train ended with exit code $rc at $(date -u +%FT%TZ)"
exit "$rc"
