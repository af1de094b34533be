#!/bin/bash -l
#COBALT -n 2
#COBALT -t 90
#COBALT -q full-node
#COBALT -A MyProject
#COBALT --attrs filesystems=home,theta-fs0
#COBALT --jobname train
#COBALT -o /home/me/run/logs/train.output
#COBALT -e /home/me/run/logs/train.error
# Cobalt job for thetagpu-cobalt, written by hvdrun qsub (directives above: no blank line before them).
# hvdrun reads the hosts from $COBALT_NODEFILE.
set -o pipefail
cd /home/me/run
module load conda/pytorch
conda activate
echo "hvdrun: job train started on $(hostname) at $(date -u +%FT%TZ)"
python -m hvdrun --cluster thetagpu-cobalt --ranks-per-node 8 -- train.py --epochs 3 --name 'it'"'"'s $HOME' && rc=0 || rc=$?
echo "$rc" > /home/me/run/logs/train.exitcode
echo "hvdrun: job train ended with exit code $rc at $(date -u +%FT%TZ)"
exit "$rc"
