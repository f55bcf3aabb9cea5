"""Audit and replay: rebuild state from the event log and explain decisions.

Nothing here writes to the live topics. Sources are Kafka (read from offset
0 or from a timestamp, never in a consumer group) or an export file made by
``apportion log export``; both give the same records in the same order
(:func:`apportion.logrecord.log_order`).
"""
