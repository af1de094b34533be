#!/bin/bash -l
#COBALT -n 1
#COBALT -t 20
#COBALT -q single-gpu
#COBALT -A MyProject
#COBALT --attrs filesystems=home,theta-fs0
#COBALT --jobname train
#COBALT -o /home/me/run/logs/train.output
#COBALT -e /home/me/run/logs/train.error
#COBALT --dependencies 101:102
#COBALT --attrs mig-mode=True
# Cobalt job for thetagpu-cobalt, written by hvdrun qsub (directives above: no blank line before them).
# hvdrun reads the hosts from $COBALT_NODEFILE. ThetaGPU: submit from a Theta login node after
# 'module load cobalt/cobalt-gpu' (Cobalt's GPU instance), or qsub sends the job to Theta's KNL nodes.
set -o pipefail
cd /home/me/run
module load conda/2021-06-26
conda activate
if ! /opt/py/bin/python -c 'import hvdrun' 2>/dev/null; then
  echo "hvdrun: error: the job's Python" /opt/py/bin/python "cannot import hvdrun on $(hostname): install hvdrun into that environment, or give hvdrun qsub --venv, --conda or --python" >&2
  echo 2 > /home/me/run/logs/train.exitcode
  exit 2
fi
echo "hvdrun: job train started on $(hostname) at $(date -u +%FT%TZ)"
/opt/py/bin/python -m hvdrun --cluster thetagpu-cobalt --ranks-per-node 1 -- train.py --epochs 3 --name 'it'"'"'s $HOME' && rc=0 || rc=$?
echo "$rc" > /home/me/run/logs/train.exitcode
echo "hvdrun: job train ended with exit code $rc at $(date -u +%FT%TZ)"
exit "$rc"
