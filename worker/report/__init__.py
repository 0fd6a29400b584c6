"""`worker report`: what the database knows of some runs, as one self-contained HTML file (data.py gathers it with
SQL aggregates, charts.py draws it with matplotlib as SVG, page.py lays it out)."""
