"""The course around the library: what learners, instructors and cloud notebooks run.

    export.py          `python -m shardlib lessons DIR`: the lessons and labs, wherever shardlib is installed;
                       the set-up cell every lesson opens with
    labgen.py          labs/ generated from solutions/ (`python -m shardlib labs`), with nbgrader metadata
    grading/           `python -m shardlib grade LAB.ipynb`: every check run in a sandbox, a score; --class
    doctor.py          `python -m shardlib doctor`: versions, GPUs, what each lesson will use here
    measure_course.py  run time, memory and disk of every lesson and lab (the instructor's guide's table)
"""
