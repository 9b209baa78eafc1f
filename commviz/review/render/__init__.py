"""review.render"""
