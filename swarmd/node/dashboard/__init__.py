"""`swarmd dashboard`: a live web page of one run, read from the DHT by a client-only node.

reading: one validated read of the run's keys; board: what is known over time (bounded
history, events); views: the JSON API's bodies; app: the Starlette app (API, page, static
files); server: the poll loop and the HTTP server on trio. No module here imports torch.
"""
